"""`launcher.LaunchSequence` on recorded launches of stand-in kernels (CPU): which arguments become the
next call's tensors, which stay fixed, and when a sequence refuses to record or to replay; and
`launcher.LaunchSequences`, the sequences a buffer set keeps by key. The GPU tests of
`tests/test_host_path.py` run them on the real kernels."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("triton")

from paroattn.kernels import launcher  # noqa: E402
from paroattn.kernels.launcher import LaunchSequence, LaunchSequences, LaunchState  # noqa: E402

STATE = LaunchState()  # the launchers' shared state (the process keeps one: `runtime.PROCESS.launches`)


class FakeEntry:
    """What `LaunchSequence.build` reads of a `launcher._Entry`: the C function, its leading arguments,
    the positions of descriptors (none here)."""

    def __init__(self, calls):
        self.descriptors = {}
        self.head = ("function", False, False, None, None, "metadata")
        self.launch = lambda *args: calls.append(args)


class FakeLauncher:
    direct_launches = raw_launches = 0


@pytest.fixture
def current(monkeypatch):
    """The current device and stream the replay asks for (no CUDA here)."""
    state = {"device": 0, "stream": 77}

    class Active:
        get_current_device = staticmethod(lambda: state["device"])
        get_current_stream = staticmethod(lambda device: state["stream"])

    class Driver:
        active = Active

    monkeypatch.setattr(launcher, "driver", Driver)
    return state


def record(calls, slots, owned_tensor, extra=()):
    """Two launches: one of (q, the owned buffer, 5, 0.5), one of (out, k, *extra)."""
    q, k, out = slots
    entry, fake = FakeEntry(calls), FakeLauncher()
    with STATE.recording() as records:
        records.append((fake, entry, (3, 2), (q, owned_tensor, 5, 0.5)))
        records.append((fake, entry, (4,), (out, k, *extra)))
    return records, fake


def test_replay_puts_the_new_calls_tensors_in_place_and_keeps_the_rest(current):
    calls = []
    buffer = torch.zeros(4)
    first = (torch.zeros(2), torch.zeros(3), torch.zeros(5))
    records, fake = record(calls, first, buffer)
    sequence = LaunchSequence.build(STATE, records, first, owned={buffer.data_ptr()})
    assert sequence is not None
    second = (torch.zeros(2), torch.zeros(3), torch.zeros(5))
    assert sequence.replay(second)
    q, k, out = second
    head = ("function", False, False, None, None, "metadata", None, None, None)
    assert calls == [(3, 2, 1, 77, *head, q.data_ptr(), buffer.data_ptr(), 5, 0.5),
                     (4, 1, 1, 77, *head, out.data_ptr(), k.data_ptr())]
    assert fake.direct_launches == fake.raw_launches == 2


def test_a_temporary_or_one_tensor_in_two_slots_is_not_recorded(current):
    calls = []
    buffer = torch.zeros(4)
    slots = (torch.zeros(2), torch.zeros(3), torch.zeros(5))
    records, _ = record(calls, slots, buffer, extra=(torch.zeros(1),))  # neither a slot nor owned
    assert LaunchSequence.build(STATE, records, slots, owned={buffer.data_ptr()}) is None
    records, _ = record(calls, slots, buffer)
    assert LaunchSequence.build(STATE, records, slots, owned=set()) is None  # the buffer is not the caller's
    shared = torch.zeros(2)
    records, _ = record(calls, (shared, shared, torch.zeros(5)), buffer)
    assert LaunchSequence.build(STATE, records, (shared, shared, torch.zeros(5)), owned={buffer.data_ptr()}) is None
    with STATE.recording() as records:
        records.append(None)  # a full launch
    assert LaunchSequence.build(STATE, records, slots, owned=set()) is None


def test_stale_sequences_launch_nothing(current, monkeypatch):
    calls = []
    buffer = torch.zeros(4)
    slots = (torch.zeros(2), torch.zeros(3), torch.zeros(5))
    records, _ = record(calls, slots, buffer)
    sequence = LaunchSequence.build(STATE, records, slots, owned={buffer.data_ptr()})
    current["device"] = 1
    assert not sequence.replay(slots)  # another current device
    current["device"] = 0
    with monkeypatch.context() as patch:
        patch.setattr(launcher.knobs.runtime, "launch_enter_hook", lambda metadata: None)
        assert not sequence.replay(slots)  # a profiler hook wants launch metadata
    assert sequence.replay(slots)
    STATE.invalidate_sequences()  # e.g. a launcher cleared
    assert not sequence.replay(slots)
    assert len(calls) == 2  # the one replay


def test_recordings_are_per_thread():
    with STATE.recording() as records:
        thread = threading.Thread(target=lambda: STATE.record("from another thread"))
        thread.start()
        thread.join()
        STATE.record("this thread's")
    STATE.record("outside the recording")
    assert records == ["this thread's"]


def test_a_buffer_sets_sequences_are_kept_by_key(current):
    """`LaunchSequences`: the launches made in a recording's scope are kept for its key and replayed for a later
    call of that key only. A recording the caller marks not replayable, or whose launches raised, keeps nothing
    (the next call of its key records again); one key more than the limit drops them all."""
    calls = []
    buffer = torch.zeros(4)
    entry, fake = FakeEntry(calls), FakeLauncher()
    sequences = LaunchSequences(STATE, owned={buffer.data_ptr()}, limit=2)

    def launches(slots):  # what one call launches: a kernel on its own tensor and the set's buffer
        STATE.record((fake, entry, (3,), (slots[0], buffer, 5)))

    first, second = (torch.zeros(2),), (torch.zeros(2),)
    assert not sequences.replay("a", first)
    with sequences.recording("a", first):
        launches(first)
    assert calls == [] and len(sequences) == 1  # a recording keeps what ran; it launches nothing itself
    assert sequences.replay("a", second, stream=5)
    head = ("function", False, False, None, None, "metadata", None, None, None)
    assert calls == [(3, 1, 1, 5, *head, second[0].data_ptr(), buffer.data_ptr(), 5)]
    assert not sequences.replay("b", second)
    with sequences.recording("b", first, replayable=False):
        launches(first)
    assert not sequences.replay("b", second)
    with pytest.raises(RuntimeError), sequences.recording("c", first):
        launches(first)
        raise RuntimeError("a launch failed")
    assert not sequences.replay("c", second)
    with sequences.recording("c", first):  # a third key: the first two go
        launches(first)
    assert len(sequences) == 1 and not sequences.replay("a", second) and sequences.replay("c", second)
    assert len(calls) == 2
