"""A deviating coordinator tries to make a silo release twice from the same DP noise: it sends
a task id again with another model (the difference of two answers cancels the noise), again to
a silo restarted on its files, or under another job of the same consortium (task ids repeat).
The silo answers a booked task id with the booked bytes, or refuses, and keys its noise by the
job it accepted and the task id."""

from __future__ import annotations

import shutil

import pytest

from fedsilo.silo.answers import KEEP_ROUNDS
from fedsilo.wire.messages import STATUS_OK, TaskResult
from tests.adversarial.helpers import JOB, SiloSite, initial_model, shifted, train, update

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]

LOUD = {"dp_sgd": {"noise_multiplier": 20.0}}


def test_a_task_id_sent_again_with_another_model_gets_the_booked_bytes_and_no_new_booking(
    tmp_path,
) -> None:
    agent = SiloSite(tmp_path).agent(**LOUD)
    model = initial_model(agent)
    _, first = train(agent, model)
    booked = len(agent.ledger.records())
    _, again = train(agent, shifted(model, 0.5))
    assert again == first, "the same task id drew a second release from the same noise"
    assert len(agent.ledger.records()) == booked


def test_a_silo_rebuilt_on_its_state_folder_and_ledger_still_answers_with_the_booked_bytes(
    tmp_path,
) -> None:
    site = SiloSite(tmp_path)
    agent = site.agent(**LOUD)
    model = initial_model(agent)
    _, first = train(agent, model)
    booked = len(agent.ledger.records())
    restarted = site.agent(**LOUD)
    _, again = train(restarted, shifted(model, 0.5))
    assert again == first, "a restarted silo drew a second release from the same noise"
    assert len(restarted.ledger.records()) == booked


def test_a_booked_task_whose_answer_is_lost_is_refused_not_answered_again(tmp_path) -> None:
    site = SiloSite(tmp_path)
    agent = site.agent(**LOUD)
    model = initial_model(agent)
    train(agent, model)
    booked = len(agent.ledger.records())
    shutil.rmtree(
        site.state_path, ignore_errors=True
    )  # the answers are gone; the ledger still holds the booking
    refused, _ = train(site.agent(**LOUD), shifted(model, 0.5))
    assert refused.status != STATUS_OK, "a booked release was answered again from its noise"
    assert "already booked" in (refused.error or "")
    assert "model" not in refused.tensors
    assert len(site.agent(**LOUD).ledger.records()) == booked


@pytest.mark.parametrize("tear", ["cut short", "a byte changed", "the digest only"])
def test_an_answer_a_power_loss_tore_is_refused_not_sent_torn_nor_answered_again(
    tmp_path, tear
) -> None:
    """Answers are kept without fsync (silo/answers.py): after a power loss the file may hold
    less than was written, or other bytes. It reads as gone, and the booked task is refused."""
    site = SiloSite(tmp_path)
    agent = site.agent(**LOUD)
    model = initial_model(agent)
    train(agent, model)
    for kept in (path for path in agent.answers.folder.iterdir() if path.stat().st_size):
        data = kept.read_bytes()
        torn = {
            "cut short": data[: len(data) // 2],
            "a byte changed": data[:100] + bytes([data[100] ^ 1]) + data[101:],
            "the digest only": data[-32:],
        }[tear]
        kept.write_bytes(torn)
    refused, _ = train(site.agent(**LOUD), shifted(model, 0.5))
    assert refused.status != STATUS_OK, "a torn answer was sent, or the task trained again"
    assert "already booked" in (refused.error or "")
    assert "model" not in refused.tensors


def test_two_jobs_with_the_same_task_ids_draw_different_noise(tmp_path) -> None:
    site = SiloSite(tmp_path)
    first_job = site.agent(JOB, **LOUD)
    model = initial_model(first_job)
    trained_first, _ = train(first_job, model)
    second_job = site.agent("cd" * 32, **LOUD)
    trained_second, _ = train(second_job, model)
    assert trained_second.ok, "a new job's task was refused as if it were the old job's"
    difference = update(trained_first, model) - update(trained_second, model)
    assert difference.abs().max() > 1.0, (
        f"two jobs released the same noise for one task id (updates differ by at most "
        f"{float(difference.abs().max()):.3g})"
    )


def test_fresh_state_repeats_a_run_bit_for_bit(tmp_path) -> None:
    answers: list[TaskResult] = []
    for run in ("one", "two"):
        agent = SiloSite(tmp_path / run).agent(**LOUD)
        answers.append(train(agent, initial_model(agent))[0])
    first, second = answers
    assert first.tensors["model"].equal(second.tensors["model"])
    assert (first.num_samples, dict(first.metrics)) == (second.num_samples, dict(second.metrics))


def test_answers_of_old_rounds_are_emptied_and_their_task_ids_stay_refused(tmp_path) -> None:
    agent = SiloSite(tmp_path).agent()
    model = initial_model(agent)
    first, _ = train(agent, model, round=1)
    for round in range(2, 2 + KEEP_ROUNDS + 1):
        train(agent, model, round=round)
    answers = list(agent.answers.folder.iterdir())
    assert sum(1 for path in answers if path.stat().st_size == 0) >= 1  # emptied, name kept
    booked = len(agent.ledger.records())
    again, _ = train(agent, shifted(model, 0.5), round=1)
    assert again.status != STATUS_OK and "already booked" in (again.error or "")
    assert first.ok and len(agent.ledger.records()) == booked
