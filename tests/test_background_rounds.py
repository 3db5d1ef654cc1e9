"""BackgroundRounds: the trainer asks for a round and never waits; rounds merge when behind,
checkpoints pause them, and a failed round surfaces in the trainer's thread."""
import threading
import time

import pytest

from torchrl_oni.train.background_rounds import BackgroundRounds


class _Gate:
    """A round that records its thread and blocks until released."""

    def __init__(self):
        self.release = threading.Event()
        self.started = threading.Semaphore(0)
        self.threads, self.finished = [], 0

    def __call__(self):
        self.threads.append(threading.current_thread().name)
        self.started.release()
        assert self.release.wait(10)
        self.finished += 1


@pytest.fixture
def gated():
    """A BackgroundRounds whose rounds block on a gate; released and closed after the test."""
    gate = _Gate()
    rounds = BackgroundRounds(gate, name="rm-thread")
    yield gate, rounds
    gate.release.set()
    rounds.close()


def test_poke_returns_at_once_and_rounds_run_in_their_thread(gated):
    gate, rounds = gated
    start = time.monotonic()
    rounds.poke()
    assert time.monotonic() - start < 0.5  # the round blocks; the caller does not
    assert gate.started.acquire(timeout=5)
    assert gate.threads == ["rm-thread"] and gate.finished == 0
    gate.release.set()
    assert rounds.wait_idle(5)
    assert rounds.rounds == 1 and gate.finished == 1


def test_pokes_during_a_round_merge_into_one_next_round(gated):
    gate, rounds = gated
    rounds.poke()
    assert gate.started.acquire(timeout=5)
    for _ in range(3):  # three updates end while the first round still runs
        rounds.poke()
    gate.release.set()
    assert rounds.wait_idle(5)
    assert (rounds.pokes, rounds.rounds, rounds.coalesced) == (4, 2, 2)


def test_paused_waits_for_the_running_round_and_holds_the_next(gated):
    gate, rounds = gated
    inside = []
    rounds.poke()
    assert gate.started.acquire(timeout=5)

    def checkpoint():
        with rounds.paused():
            inside.append(gate.finished)  # what a checkpoint sees: no round half done
            rounds.poke()
            time.sleep(0.3)
            inside.append(len(gate.threads))  # the round asked for meanwhile has not started

    saver = threading.Thread(target=checkpoint)
    saver.start()
    time.sleep(0.2)
    assert not inside  # still waiting for the running round
    gate.release.set()
    saver.join(5)
    assert inside == [1, 1]
    assert rounds.wait_idle(5) and rounds.rounds == 2  # released: the held round ran


def test_a_failed_round_raises_in_the_trainer_thread_once():
    def broken():
        raise ValueError("CUDA out of memory (say)")

    rounds = BackgroundRounds(broken, name="reward-model training")
    rounds.poke()
    with pytest.raises(RuntimeError, match="reward-model training failed: ValueError: CUDA out of memory") as info:
        rounds.wait_idle(5)
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(RuntimeError, match="poked after close"):  # the thread is gone: no silent no-op
        rounds.poke()
    rounds.close()  # the error was seen: closing does not raise it again


def test_close_lets_the_running_round_finish_and_raises_an_unseen_error():
    gate = _Gate()
    rounds = BackgroundRounds(gate)
    rounds.poke()
    assert gate.started.acquire(timeout=5)
    threading.Timer(0.2, gate.release.set).start()
    rounds.close()
    assert gate.finished == 1 and not rounds._thread.is_alive()
    rounds.close()  # idempotent

    def broken():
        raise KeyError("x")

    failing = BackgroundRounds(broken)
    failing.poke()
    time.sleep(0.2)
    with pytest.raises(RuntimeError, match="KeyError"):
        failing.close()
