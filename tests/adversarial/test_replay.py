"""Replay protection survives a coordinator restart (issue 17, finding 6b): what the envelope
verifier accepted is remembered in the coordinator's state file, so a captured message sent
again after a restart is refused as a replay, while the state store's own tables are untouched.
(test_real_processes.py replays an envelope to a restarted `fedsilo coordinator start`.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from nacl.signing import SigningKey

from fedsilo.coordinator.replay_store import ReplayStore
from fedsilo.coordinator.state import StateStore
from fedsilo.wire.envelope import REPLAY, STALE, EnvelopeRejected, EnvelopeVerifier, seal
from fedsilo.wire.framing import MessageRejected, check_answers

SILO = SigningKey(bytes([9]) * 32)
NOW = 1_700_000_000.0
MAX_AGE = 300.0
PAYLOAD = b"a result the coordinator took"


def coordinator_verifier(state: Path, now: float) -> tuple[EnvelopeVerifier, ReplayStore]:
    """The verifier a coordinator builds at start-up on its state file (opened as a state
    store first, as `fedsilo coordinator start` does), with the clock at `now`."""
    StateStore(state).close()
    store = ReplayStore(state, MAX_AGE)
    verifier = EnvelopeVerifier(
        "study", {"silo-a": SILO.verify_key}, MAX_AGE, clock=lambda: now, memory=store
    )
    return verifier, store


def captured(sent_at: float = NOW):
    return seal(
        PAYLOAD,
        signing_key=SILO,
        sender="silo-a",
        deployment="study",
        round=3,
        task_id="result/41",
        clock=lambda: sent_at,
    )


def test_a_message_accepted_before_a_restart_is_refused_as_a_replay_after_it(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.db"
    before, store = coordinator_verifier(state, NOW)
    before.verify(captured(), PAYLOAD)
    store.close()
    after, store = coordinator_verifier(state, NOW + 60)
    with pytest.raises(EnvelopeRejected) as refused:
        after.verify(captured(), PAYLOAD)
    assert refused.value.reason == REPLAY
    store.close()


def test_a_message_past_the_freshness_window_is_forgotten_and_still_refused_as_stale(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.db"
    before, store = coordinator_verifier(state, NOW)
    before.verify(captured(), PAYLOAD)
    store.close()
    later, store = coordinator_verifier(state, NOW + MAX_AGE + 1)
    assert store.recall(since=NOW + 1) == []  # nothing older than the window is kept
    with pytest.raises(EnvelopeRejected) as refused:
        later.verify(captured(), PAYLOAD)
    assert refused.value.reason == STALE
    store.close()


def test_the_state_store_still_opens_its_file_beside_the_replay_memory(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    verifier, store = coordinator_verifier(state, NOW)
    verifier.verify(captured(), PAYLOAD)
    store.close()
    with StateStore(state) as reopened:
        reopened.open_deployment("study", "digest", "{}")
        assert reopened.last_round("study") is None


def test_a_silo_refuses_a_recorded_reply_passed_off_as_the_answer_to_a_new_request() -> None:
    """The silo's side: each request carries a fresh random id and the coordinator's reply
    names it, so a reply captured earlier (before either side restarted) answers nothing new."""
    coordinator = SigningKey(bytes([7]) * 32)
    first, second = (
        seal(b"pull", signing_key=SILO, sender="silo-a", deployment="study", round=0, task_id=t)
        for t in ("pull/aaaa", "pull/bbbb")
    )
    reply = seal(
        b"a task",
        signing_key=coordinator,
        sender="coordinator",
        deployment="study",
        round=0,
        task_id=f"silo-a/{first.task_id}",
    )
    check_answers(reply, first)
    with pytest.raises(MessageRejected, match="replay: the reply answers 'silo-a/pull/aaaa'"):
        check_answers(reply, second)
