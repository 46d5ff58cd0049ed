# Two commands on a fresh machine: `make demo` and `make test`. Both set themselves up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo compare test docs fuzz lint bench proto clean flower-env check-wheel check-image

setup: $(STAMP)

# The example plug-in package (examples/fedsilo-example-plugins) too: its tests need it installed.
$(STAMP): pyproject.toml constraints.txt examples/fedsilo-example-plugins/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps -e examples/fedsilo-example-plugins
	touch $(STAMP)

# The real deployment path: a provisioned consortium of processes over mutual-TLS gRPC.
demo: $(STAMP)
	$(BIN)/fedsilo demo --folder runs/demo-$$(date +%Y%m%d-%H%M%S)

# The same hospitals in one process: FedAvg next to local-only and central training.
compare: $(STAMP)
	$(BIN)/fedsilo simulate --compare local --compare central --out runs/compare

test: $(STAMP)
	$(BIN)/ruff check .
	$(MAKE) docs
	$(BIN)/python -m pytest -q

# The product as a user installs it (ci/, also run by .ci/run): the wheel built and installed
# into a fresh virtualenv outside the checkout; the container image and the compose consortium
# (needs root and podman; installs podman, runc and mmdebstrap when missing).
check-wheel: $(STAMP)
	ci/check-wheel.sh

check-image: $(STAMP)
	ci/check-image.sh

# The documentation site (mkdocs.yml) into site/; --strict: a broken link, anchor or reference
# fails it (and so `make test`).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# For a release: many more drawn policies than CI's fixed sample (tests/test_policy_space.py),
# at a fresh seed it prints first (FEDSILO_POLICY_SEED=N make fuzz draws those again).
fuzz: $(STAMP)
	@seed=$${FEDSILO_POLICY_SEED:-$$(date +%s)}; echo "policy-space seed $$seed"; \
	FEDSILO_POLICY_SEED=$$seed FEDSILO_POLICY_EXAMPLES=$${FEDSILO_POLICY_EXAMPLES:-1000} \
	FEDSILO_POLICY_DEPLOYED=$${FEDSILO_POLICY_DEPLOYED:-6} \
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_policy_space.py --hypothesis-show-statistics

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m bench.engine_overhead

# Regenerate the gRPC stubs after editing wire/fedsilo.proto (tests check they are current).
proto: $(STAMP)
	$(BIN)/python -m fedsilo.wire.stubs

# Flower (flwr) for bench/transport.py: its own venv, as every flwr>=1.20 pins protobuf<7.
flower-env:
	python3 -m venv .venv-flwr && .venv-flwr/bin/pip install -c constraints.txt "flwr==1.41.0" numpy psutil torch==2.13.0

clean:
	rm -rf $(VENV) .venv-flwr .venv-compose runs build site *.egg-info
