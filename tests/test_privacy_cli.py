"""`fedsilo privacy audit` and `fedsilo privacy report`: the privacy officer's view of the
silos' ledgers; any finding is one line and a non-zero exit."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsilo.ops.cli import main
from fedsilo.ops.job_id import job_id
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.ledger import PrivacyLedger, payload_digest

DELTA = 1e-5
TRAIN = Mechanism.dp_sgd(noise_multiplier=2.0, sample_rate=1.0, steps=5, max_grad_norm=1.0)


def invoke(*args: str):
    return CliRunner().invoke(main, ["privacy", *args], catch_exceptions=False)


def write_ledger(path: Path, rounds: int = 3) -> PrivacyLedger:
    """A silo's ledger: a DP deployment trained for `rounds` rounds, and one deployment
    without DP."""
    ledger = PrivacyLedger(path)
    for round_ in range(rounds):
        ledger.append(
            deployment="heart-dp",
            round=round_,
            task_id=f"train-{round_}",
            mechanism=TRAIN,
            payload_digest=payload_digest(b"model %d" % round_),
            delta=DELTA,
        )
    ledger.append(
        deployment="heart-open",
        round=0,
        task_id="evaluate-0",
        mechanism=Mechanism.none(),
        payload_digest=payload_digest(b"metrics"),
        delta=None,
    )
    return ledger


@pytest.fixture
def ledger_file(tmp_path: Path) -> Path:
    path = tmp_path / "hospital-a.jsonl"
    write_ledger(path)
    return path


def test_audit_shows_spent_and_remaining_per_deployment(ledger_file: Path) -> None:
    spent = PrivacyLedger(ledger_file).spent("heart-dp")
    result = invoke("audit", "--ledger", str(ledger_file), "--cap", "20")
    assert result.exit_code == 0, result.output
    assert "heart-dp" in result.output and "heart-open" in result.output
    assert f"{spent:.6g}" in result.output
    assert f"{20 - spent:.6g}" in result.output
    assert "no DP" in result.output
    assert "OK" in result.output and "chain intact" in result.output


def test_audit_json_is_for_machines(ledger_file: Path) -> None:
    ledger = PrivacyLedger(ledger_file)
    result = invoke("audit", "--ledger", str(ledger_file), "--cap", "20", "--json")
    assert result.exit_code == 0
    document = json.loads(result.stdout)
    assert document["ok"] is True and document["reason"] is None
    assert document["records"] == 4 and document["head"] == ledger.head()
    dp, open_ = document["deployments"]
    assert dp["booked"] == dp["recomputed"] == ledger.spent("heart-dp")
    assert dp["remaining"] == pytest.approx(20 - ledger.spent("heart-dp"))
    assert (dp["delta"], dp["accountant"], dp["cap"]) == (DELTA, "rdp", 20.0)
    assert (open_["booked"], open_["cap"], open_["remaining"]) == (None, None, None)


def test_audit_names_an_edited_record_and_fails(ledger_file: Path) -> None:
    lines = ledger_file.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"steps":5', b'"steps":4')
    ledger_file.write_bytes(b"".join(lines))
    for extra in ((), ("--json",)):
        result = invoke("audit", "--ledger", str(ledger_file), *extra)
        assert result.exit_code == 1
        (reason,) = result.stderr.strip().splitlines()
        assert reason.startswith(f"Error: {ledger_file}: line 2 (seq 2): edited:")


def test_audit_with_the_coordinators_anchor_catches_a_deleted_last_record(
    ledger_file: Path,
) -> None:
    anchor = PrivacyLedger(ledger_file).head()
    ledger_file.write_bytes(b"".join(ledger_file.read_bytes().splitlines(keepends=True)[:-1]))
    assert invoke("audit", "--ledger", str(ledger_file)).exit_code == 0
    result = invoke("audit", "--ledger", str(ledger_file), "--anchor", anchor)
    assert result.exit_code == 1
    assert "anchor not held" in result.stderr and "the ledger ends at seq 3" in result.stderr


def test_audit_fails_where_a_deployment_went_over_the_cap(ledger_file: Path) -> None:
    result = invoke("audit", "--ledger", str(ledger_file), "--cap", "0.5")
    assert result.exit_code == 1
    assert "deployment heart-dp: seq 1" in result.stderr and "over the cap 0.5" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--ledger", "missing.jsonl"), "cannot read the ledger"),
        (("--anchor", "abc"), "anchor must be 64 hex digits"),
    ],
)
def test_audit_errors_are_one_clear_line(ledger_file: Path, args, message: str) -> None:
    result = invoke("audit", "--ledger", str(ledger_file), *args)
    assert result.exit_code == 1
    assert message in result.stderr


def test_report_plots_epsilon_over_rounds_for_each_silo(tmp_path: Path) -> None:
    for silo in ("hospital-a", "hospital-b"):
        write_ledger(tmp_path / f"{silo}.jsonl", rounds=4)
    out = tmp_path / "epsilon.png"
    result = invoke(
        "report",
        "--ledger",
        str(tmp_path / "hospital-a.jsonl"),
        "--ledger",
        str(tmp_path / "hospital-b.jsonl"),
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(b"\x89PNG")
    assert f"wrote {out}" in result.output


def test_report_refuses_a_ledger_that_fails_its_audit(ledger_file: Path, tmp_path: Path) -> None:
    ledger_file.write_bytes(ledger_file.read_bytes()[:-5])
    out = tmp_path / "epsilon.png"
    result = invoke("report", "--ledger", str(ledger_file), "--out", str(out))
    assert result.exit_code == 1
    assert "truncated tail" in result.stderr
    assert not out.exists()


def test_report_needs_a_deployment_that_books_epsilon(tmp_path: Path) -> None:
    path = tmp_path / "open.jsonl"
    PrivacyLedger(path).append(
        deployment="open",
        round=0,
        task_id="t",
        mechanism=Mechanism.none(),
        payload_digest=payload_digest(b""),
        delta=None,
    )
    result = invoke("report", "--ledger", str(path), "--out", str(tmp_path / "e.png"))
    assert result.exit_code == 1
    assert "no deployment in these ledgers books epsilon" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--receipts", "r.json"), "--receipts and --verify-key go together"),
        (("--receipts", "missing.json", "--verify-key", "ab" * 32), "missing.json: cannot read"),
        (("--receipts", "r.json", "--verify-key", "xyz"), "--verify-key: not a hex-encoded key"),
    ],
)
def test_audit_with_receipts_errors_are_one_clear_line(
    ledger_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.json").write_text(json.dumps({"receipts": []}))
    result = invoke("audit", "--ledger", str(ledger_file), *args)
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert message in line


def test_receipts_export_refuses_a_missing_state_file_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "state.db"
    result = invoke("receipts", "--state", str(missing), "--out", str(tmp_path / "r.json"))
    assert result.exit_code == 1
    assert result.stderr.strip() == f"Error: {missing}: no such state file"
    assert not missing.exists() and not (tmp_path / "r.json").exists()


def test_report_labels_silos_by_name_and_passes_the_cap_to_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn = {}
    monkeypatch.setattr(
        "fedsilo.ops.privacy_cli.plot_epsilon",
        lambda out, panels, cap, title: drawn.update(panels=panels, cap=cap),
    )
    for site in ("silo-a", "silo-b"):  # a deployment's layout: the same file name per site
        (tmp_path / "sites" / site).mkdir(parents=True)
        write_ledger(tmp_path / "sites" / site / "privacy-ledger.jsonl", rounds=2)
    other = tmp_path / "elsewhere.jsonl"
    write_ledger(other, rounds=1)
    result = invoke(
        "report",
        "--ledger", str(tmp_path / "sites" / "silo-a" / "privacy-ledger.jsonl"),
        "--ledger", str(tmp_path / "sites" / "silo-b" / "privacy-ledger.jsonl"),
        "--ledger", f"hospital-c={other}",
        "--cap", "8",
        "--out", str(tmp_path / "e.png"),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert list(drawn["panels"]) == ["silo-a", "silo-b", "hospital-c"]
    assert drawn["cap"] == 8.0
    # one line per DP deployment in a silo's panel, at each round's end
    assert list(drawn["panels"]["silo-a"]) == ["heart-dp"]
    assert [r for r, _ in drawn["panels"]["silo-a"]["heart-dp"]] == [0, 1]


def test_report_refuses_a_cap_that_is_not_positive(ledger_file: Path, tmp_path: Path) -> None:
    result = invoke(
        "report", "--ledger", str(ledger_file), "--cap", "0", "--out", str(tmp_path / "e.png")
    )
    assert result.exit_code == 1
    assert "--cap: must be a positive epsilon" in result.stderr


def write_site(tmp_path: Path, rules: str) -> tuple[Path, PrivacyLedger, list[str]]:
    """A site's silo.yaml with `rules`, and its ledger: two DP jobs (2 and 3 rounds) whose ids
    share their first 33 characters, as two policies of one name signed apart would."""
    config = tmp_path / "silo.yaml"
    config.write_text(
        "kit: kit\ndata:\n  source: csv\n  path: heart.csv\n  target: y\n"
        f"ledger: site-ledger.jsonl\nrules:\n{rules}"
    )
    ledger = PrivacyLedger(tmp_path / "site-ledger.jsonl")
    jobs = [
        job_id("multicenter-heart-failure-fedavg", digest)
        for digest in ("3f9a1c2e11", "77b0d4e122")
    ]
    assert jobs[0][:33] == jobs[1][:33]
    for job, rounds in zip(jobs, (2, 3), strict=True):
        for round_ in range(rounds):
            ledger.append(
                deployment=job,
                round=round_,
                task_id=f"train-{round_}",
                mechanism=TRAIN,
                payload_digest=payload_digest(b"%s %d" % (job.encode(), round_)),
                delta=DELTA,
            )
    return config, ledger, jobs


def test_audit_at_80_columns_tells_jobs_with_one_long_prefix_apart(tmp_path: Path) -> None:
    config, ledger, jobs = write_site(tmp_path, "  epsilon_cap: 12\n  total_epsilon_cap: 20\n")
    result = CliRunner(env={"COLUMNS": "80"}).invoke(
        main, ["privacy", "audit", "--config", str(config)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    table = lines[: next(i for i, line in enumerate(lines) if line.startswith("all jobs")) + 1]
    assert all(len(line) <= 80 for line in table)
    spent = [ledger.spent(job) for job in jobs]
    rows = []
    for job, records, epsilon in zip(jobs, ("2", "3"), spent, strict=True):
        # the row of each job: its own digest (its distinct tail) beside its own epsilon and cap
        (row,) = [line for line in table if job[-8:] in line]
        shown, *numbers = row.split()
        assert numbers == [records, f"{epsilon:.6g}", f"{epsilon:.6g}", "1e-05", "12"] + [
            f"{12 - epsilon:.6g}"
        ]
        assert "…" in shown and f"{shown} is job {job}" in lines  # the legend names it whole
        rows.append(shown)
    assert len(set(rows)) == 2
    total = spent[0] + spent[1]
    assert table[-1].split() == ["all", "jobs", "5", f"{total:.6g}", f"{total:.6g}", "-", "20"] + [
        f"{20 - total:.6g}"
    ]
    assert "OK" in result.output


def test_audit_fails_where_the_sites_jobs_together_went_over_its_total_cap(
    tmp_path: Path,
) -> None:
    config, ledger, jobs = write_site(tmp_path, "  total_epsilon_cap: 15\n")
    total = sum(ledger.spent(job) for job in jobs)
    result = invoke("audit", "--config", str(config))
    assert result.exit_code == 1
    assert f"over all jobs, {total:.6g}, is over its total cap 15" in result.output
    document = json.loads(invoke("audit", "--config", str(config), "--json").stdout)
    assert document["site"]["booked"] == pytest.approx(total)
    assert (document["site"]["total_cap"], document["site"]["remaining"]) == (15, 0.0)
    # --total-cap overrides the site's rule
    assert invoke("audit", "--config", str(config), "--total-cap", "30").exit_code == 0
