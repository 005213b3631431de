"""The CPU emulator of CUDA-graph capture / replay (:class:`mmfast._graph_emulator.ReplayEmulator`) is
faithful: replays see new values of the static inputs, in-place updates advance, views follow their
base, Python values are frozen at capture, host reads refuse to capture, and capture launches nothing."""

from __future__ import annotations

import pytest
import torch

from mmfast._graph_emulator import CaptureHostReadError, ReplayEmulator


def _captured(fn) -> ReplayEmulator:
    graph = ReplayEmulator()
    graph.capture(fn)
    return graph


def test_replay_follows_a_static_input_copied_in():
    x, w = torch.randn(3, 4), torch.randn(4, 2)

    def fn():
        return torch.relu(x @ w + 1).sum(-1) * x[:, 0]  # [3]; x[:, 0] a view of the input

    graph = _captured(fn)
    assert {id(t) for t in graph.inputs} == {id(x), id(w)}  # what the graph reads from outside
    for _ in range(3):
        x.copy_(torch.randn(3, 4))
        assert torch.equal(graph.replay(), fn())


def test_a_view_of_an_input_is_not_poisoned_and_follows_it():
    x = torch.arange(6.0).reshape(2, 3)
    graph = _captured(lambda: x[:, 1:].t())  # no kernel at all: the output is a view of the input
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3))
    x.add_(1)
    assert torch.equal(graph.replay(), x[:, 1:].t()) and not graph.ops


def test_capture_launches_nothing_and_its_output_is_garbage_until_replayed():
    buf, pos = torch.zeros(5), torch.zeros((), dtype=torch.long)

    def fn():
        buf.index_copy_(0, pos + torch.arange(1), torch.ones(1))
        pos.add_(1)
        return buf * 2

    graph = _captured(fn)
    assert int(pos) == 0 and not buf.any()  # the capture's writes are undone
    assert graph.out.isnan().all()  # memory the capture allocated holds nothing meaningful
    assert torch.equal(graph.replay(), torch.tensor([2.0, 0, 0, 0, 0]))


def test_in_place_updates_at_a_device_index_advance_across_replays():
    buf, pos = torch.zeros(2, 6), torch.zeros((), dtype=torch.long)
    val = torch.zeros(2, 1)

    def fn():
        idx = pos + torch.arange(1)  # [1] the write index, on the device
        buf.index_copy_(1, idx, val)
        pos.add_(1)
        valid = torch.arange(buf.shape[1]) < pos  # [C] in-graph mask from the index
        return (buf * valid).sum(1)

    graph = _captured(fn)
    for step in range(1, 5):
        val.fill_(step)
        got = graph.replay()
        assert int(pos) == step
        assert torch.equal(buf[0, :step], torch.arange(1, step + 1, dtype=torch.float))
        assert torch.equal(got, torch.full((2,), float(sum(range(1, step + 1)))))


def test_views_follow_their_base():
    x = torch.randn(4, 3)
    out_buf = torch.zeros(4, 3)

    def fn():
        y = x.clone()  # fresh, recomputed at replay
        y[:, 0].fill_(0)  # a write through a view of it
        z = y.t()[1:]  # [2, 4] views of a fresh tensor
        out_buf[:, 1:].copy_(z.t())  # a write into a view of an outside tensor
        return (z * 3).expand(2, 2, 4).sum(0)

    graph = _captured(fn)
    for _ in range(3):
        x.copy_(torch.randn(4, 3))
        want = fn()
        out_buf.zero_()
        assert torch.equal(graph.replay(), want)
        assert torch.equal(out_buf[:, 1:], x[:, 1:]) and not out_buf[:, 0].any()


def test_python_values_are_frozen_at_capture():
    """What Python read at capture (a host int, a shape, the tensor an attribute pointed at) is replayed
    as it was: a CUDA graph behaves so, and the emulator reproduces the stale result."""

    class Host:
        n = 2
        t = torch.ones(3)

    def fn():
        return Host.t * Host.n + torch.arange(3) * Host.n  # [3]

    graph = _captured(fn)
    Host.n, Host.t = 5, torch.full((3,), 10.0)  # rebinding: the graph still reads the old tensor
    assert torch.equal(graph.replay(), torch.tensor([2.0, 4, 6]))  # 1 * 2 + [0, 1, 2] * 2
    assert torch.equal(fn(), torch.tensor([50.0, 55, 60]))  # what the Python computes now


@pytest.mark.parametrize(
    "read",
    [
        lambda t: int(t[0]),
        lambda t: t.sum().item(),
        lambda t: bool(t.any()),
        lambda t: t.tolist(),
        lambda t: t.numpy(),
        lambda t: t.nonzero(),
        lambda t: t[t > 0],
        lambda t: torch.equal(t, t),
    ],
    ids=["int", "item", "bool", "tolist", "numpy", "nonzero", "masked_select", "equal"],
)
def test_host_reads_refuse_to_capture(read):
    t = torch.arange(4.0)

    def fn():
        read(t)
        return t + 1

    with pytest.raises(CaptureHostReadError):
        ReplayEmulator().capture(fn)
    assert torch.equal(t, torch.arange(4.0)) and t.tolist() == [0.0, 1.0, 2.0, 3.0]  # tolist is back


def test_integer_index_tensors_capture_and_replay():
    """``t[rows, cols]`` with integer index tensors has the indices' shape (a CUDA graph captures it; a boolean
    mask's output shape is its count, refused above): the replay reads the new values at the new indices."""
    t = torch.arange(12.0).view(3, 4)
    rows, cols = torch.tensor([2, 0]), torch.tensor([1, 3])

    graph = ReplayEmulator()
    graph.capture(lambda: t[rows, cols] * 2)
    t.add_(100.0)
    rows.copy_(torch.tensor([1, 1]))
    assert torch.equal(graph.replay(), torch.tensor([210.0, 214.0]))  # (100 + [5, 7]) * 2


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_small_integer_tensors_made_while_capturing(dtype):
    """Tensors the capture allocates are poisoned with a value in their dtype's range (int8 cannot hold -7777)."""
    t = torch.arange(4)
    graph = ReplayEmulator()
    graph.capture(lambda: (t > 1).to(dtype) * 3)
    t.copy_(torch.tensor([5, 0, 0, 5]))
    assert torch.equal(graph.replay(), torch.tensor([3, 0, 0, 3], dtype=dtype))


def test_replay_is_quick_on_a_small_step():
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    x = torch.randn(2, 8, 32)
    with torch.inference_mode():
        graph = _captured(lambda: layer(x))
        x.copy_(torch.randn(2, 8, 32))
        assert torch.allclose(graph.replay(), layer(x), atol=1e-6)
