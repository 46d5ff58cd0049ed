"""A silo behind a hospital's HTTP CONNECT proxy: silo.yaml's `coordinator.proxy` or the
`https_proxy`/`no_proxy` environment, as gRPC reads it, chooses the route; mutual TLS runs end
to end through the tunnel. A real proxy (proxy.py, a separate process on 127.0.0.1) carries a
real job; gRPC does not exempt loopback from a proxy, so 127.0.0.1 goes through it unless
`no_proxy` lists it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from fedsilo.ops.cli import main
from fedsilo.ops.demo import free_port
from fedsilo.silo.proxy import ProxyError, route
from tests.deployment import SILOS, Consortium, policy_document, provision, wait_for

ADDRESS = "coordinator.example.org:50051"
PROXY = "http://proxy.hospital:3128"


def without_proxies(**variables: str) -> dict[str, str]:
    """This process's environment without any proxy variable, plus `variables`."""
    environ = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    return {**environ, **variables}


def test_silo_yamls_proxy_takes_precedence_over_the_environment() -> None:
    chosen = route(ADDRESS, PROXY, {"https_proxy": "http://other:8080"})
    assert (chosen.proxy, chosen.reason) == (PROXY, "silo.yaml coordinator.proxy")
    assert chosen.options() == [("grpc.http_proxy", PROXY)]
    direct = route(ADDRESS, "direct", {"https_proxy": "http://other:8080"})
    assert direct.proxy is None and direct.options() == [("grpc.enable_http_proxy", 0)]


def test_the_environment_is_read_in_grpcs_order_and_an_empty_variable_means_no_proxy() -> None:
    both = {"http_proxy": "http://plain:80", "https_proxy": "http://secure:443"}
    assert route(ADDRESS, None, both).proxy == "http://secure:443"
    assert route(ADDRESS, None, {**both, "grpc_proxy": "http://grpc:1"}).proxy == "http://grpc:1"
    assert route(ADDRESS, None, {**both, "https_proxy": ""}).proxy is None
    assert route(ADDRESS, None, {}).proxy is None


def test_no_proxy_exempts_a_listed_host_by_suffix_or_cidr_whichever_set_the_proxy() -> None:
    for listed in ("example.org", ".example.org", "other, coordinator.example.org"):
        assert route(ADDRESS, PROXY, {"no_proxy": listed}).proxy is None
    assert route(ADDRESS, PROXY, {"no_proxy": "example.com"}).proxy == PROXY
    environ = {"https_proxy": PROXY, "no_proxy": "10.0.0.0/8"}
    assert route("10.1.2.3:50051", None, environ).proxy is None
    assert route("192.168.1.2:50051", None, environ).proxy == PROXY
    # no_grpc_proxy, when set, is read instead of no_proxy
    assert route(ADDRESS, PROXY, {"no_grpc_proxy": "x", "no_proxy": "example.org"}).proxy == PROXY


def test_loopback_is_proxied_unless_no_proxy_lists_it_and_upper_case_names_are_not_read() -> None:
    assert route("127.0.0.1:50051", None, {"https_proxy": PROXY}).proxy == PROXY
    unread = route(ADDRESS, None, {"HTTPS_PROXY": PROXY})
    assert unread.proxy is None and "not HTTPS_PROXY" in unread.reason


def test_a_proxy_password_never_reaches_the_log() -> None:
    chosen = route(ADDRESS, "http://ward:s3cret@proxy.hospital:3128", {})
    assert "s3cret" not in chosen.describe() and "ward:***@proxy.hospital:3128" in chosen.describe()


@pytest.mark.parametrize(
    "proxy",
    ["proxy.hospital:3128", "https://proxy.hospital:3128", "http://proxy.hospital", "http://:3128"],
)
def test_a_malformed_proxy_in_the_environment_is_refused_naming_the_variable(proxy: str) -> None:
    with pytest.raises(ProxyError, match=r"^https_proxy: .*coordinator\.proxy"):
        route(ADDRESS, None, {"https_proxy": proxy})


def test_a_silo_refuses_to_start_with_a_malformed_proxy_naming_the_key_or_variable(
    tmp_path: Path,
) -> None:
    consortium = provision(tmp_path, ("silo-0",))
    config = consortium.write_silo_config("silo-0", proxy="proxy.hospital:3128")
    runner = CliRunner()
    result = runner.invoke(main, ["silo", "start", "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert "coordinator.proxy" in result.output and "http://" in result.output
    assert "Traceback" not in result.output
    document = yaml.safe_load(config.read_text())
    del document["coordinator"]
    config.write_text(yaml.safe_dump(document))
    result = runner.invoke(
        main, ["silo", "start", "--config", str(config)], env={"https_proxy": "proxy:3128"}
    )
    assert result.exit_code == 1, result.output
    assert "https_proxy: 'proxy:3128'" in result.output and "Traceback" not in result.output


def start_proxy(consortium: Consortium, name: str) -> int:
    """proxy.py on 127.0.0.1 in a process of its own; its port."""
    port_file = consortium.root / f"{name}.port"
    consortium.spawn(
        name,
        [
            *(sys.executable, "-m", "proxy", "--hostname", "127.0.0.1", "--port", "0"),
            *("--port-file", str(port_file), "--num-workers", "1", "--num-acceptors", "1"),
        ],
        without_proxies(),
    )
    text = wait_for(lambda: port_file.is_file() and port_file.read_text().strip(), 30, name)
    return int(text)


def tunnels(consortium: Consortium, name: str) -> list[str]:
    """The targets of the CONNECT tunnels proxy `name` opened (its access log: one line each,
    written when the tunnel closes)."""
    return re.findall(r" - CONNECT (\S+) - ", consortium.log(name))


def test_a_job_runs_with_silos_behind_proxies_through_real_connect_tunnels(
    tmp_path: Path,
) -> None:
    consortium = provision(tmp_path)
    try:
        configured, environment = (
            start_proxy(consortium, "proxy-a"),
            start_proxy(consortium, "proxy-b"),
        )
        nowhere = f"http://127.0.0.1:{free_port()}"  # no proxy listens there
        coordinator = f"127.0.0.1:{consortium.port}"
        policy = consortium.write_policy(
            policy_document(rounds=2, participants={"min_silos": 3, "phase_timeout_s": 20})
        )
        consortium.start_coordinator(policy)
        # silo.yaml's proxy wins over an https_proxy that leads nowhere
        consortium.start_silo(
            "silo-0",
            consortium.write_silo_config("silo-0", proxy=f"http://127.0.0.1:{configured}"),
            env=without_proxies(https_proxy=nowhere),
        )
        consortium.start_silo(
            "silo-1", env=without_proxies(https_proxy=f"http://127.0.0.1:{environment}")
        )
        # no_proxy sends silo-2 directly, past a proxy that leads nowhere
        consortium.start_silo(
            "silo-2", env=without_proxies(https_proxy=nowhere, no_proxy="localhost,127.0.0.1")
        )
        assert consortium.wait("coordinator") == 0, consortium.log("coordinator")
        for silo in SILOS:
            assert consortium.wait(silo, 30) == 0, consortium.log(silo)
            assert "accepted policy" in consortium.log(silo)
        for proxy in ("proxy-a", "proxy-b"):
            wait_for(lambda proxy=proxy: tunnels(consortium, proxy), 15, f"{proxy}'s tunnels")
            assert set(tunnels(consortium, proxy)) == {coordinator}
        assert (
            f"through the proxy http://127.0.0.1:{configured} (silo.yaml coordinator.proxy)"
            in consortium.log("silo-0")
        )
        assert f"through the proxy http://127.0.0.1:{environment} (https_proxy)" in consortium.log(
            "silo-1"
        )
        assert "directly (no_proxy lists 127.0.0.1" in consortium.log("silo-2")
    finally:
        consortium.stop_all()
