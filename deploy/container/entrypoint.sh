#!/bin/sh
# fedsilo-entrypoint: the container image's entry point. It runs `fedsilo ARGS...` after three
# checks that turn a container started wrongly into one clear message and exit status 1:
#   - no command: the image serves three roles (coordinator, silo agent, admin CLI) and guesses
#     none of them;
#   - a service (`coordinator serve`, `silo start`) whose state folder is not a volume: the
#     coordinator's jobs, or a silo's privacy ledger, would be lost with the container, and a lost
#     ledger forgets the privacy budget a site has spent (FEDSILO_STATE_VOLUME= turns the check
#     off, for a throw-away try);
#   - FEDSILO_KIT_SECRET names a mounted kit (a Kubernetes Secret) that cannot be staged: it is
#     copied to /run/fedsilo/kit (FEDSILO_KIT_STAGED) with owner-only modes, which fedsilo
#     requires of private keys and a Secret volume cannot give a non-root user.
set -eu

state=${FEDSILO_STATE_VOLUME-/var/lib/fedsilo}
say() { printf 'fedsilo-entrypoint: %s\n' "$*" >&2; }

if [ $# -eq 0 ]; then
    say "no command given: this image runs one fedsilo command, for example
  coordinator serve --kit /etc/fedsilo/kit --state /var/lib/fedsilo/state.db --listen 0.0.0.0:50051
  silo start --config /etc/fedsilo/silo.yaml
  job submit POLICY --kit /etc/fedsilo/kit
(\`--help\` lists every command; docs/how-to/hospital-it.md, 'Install')"
    exit 1
fi

is_mount() {  # the fifth field of /proc/self/mountinfo is the mount point
    awk -v path="$1" '$5 == path { found = 1 } END { exit !found }' /proc/self/mountinfo
}

case "$1 ${2:-}" in
"coordinator serve" | "silo start")
    if [ -n "$state" ] && ! is_mount "$state"; then
        say "$state is not a volume: \`$1 $2\` keeps its state there (the coordinator's jobs, a silo's privacy ledger) and it would be lost with the container; mount one, e.g. \`-v fedsilo-state:$state\` (or set FEDSILO_STATE_VOLUME= to run without, for a throw-away try)"
        exit 1
    fi
    # the health file of an earlier container on this volume must not pass for this one's
    rm -f "${FEDSILO_HEALTH_FILE:-}"
    ;;
esac

if [ -n "${FEDSILO_KIT_SECRET:-}" ]; then
    kit=${FEDSILO_KIT_STAGED:-/run/fedsilo/kit}
    if [ ! -d "$FEDSILO_KIT_SECRET" ]; then
        say "FEDSILO_KIT_SECRET=$FEDSILO_KIT_SECRET is not a folder: mount the kit's Secret there"
        exit 1
    fi
    if [ ! -f "$FEDSILO_KIT_SECRET/kit.yaml" ]; then
        say "the kit in $FEDSILO_KIT_SECRET has no kit.yaml: make its Secret from every file of one kit folder (kubectl create secret generic NAME --from-file=kits/silos/NAME/)"
        exit 1
    fi
    rm -rf "$kit"
    mkdir -p "$kit"
    chmod 0700 "$kit"
    for file in "$FEDSILO_KIT_SECRET"/*; do  # a Secret's files are links into ..data/: follow
        [ -f "$file" ] && install -m 0600 "$file" "$kit/"
    done
fi

exec fedsilo "$@"
