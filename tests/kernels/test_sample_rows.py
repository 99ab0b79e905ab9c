"""``cpu_ops.sample_rows``: the native inverse-CDF sampler against its torch reference, its
distribution against the softmax, and the rows it must never draw from."""

from __future__ import annotations

import os

import pytest
import torch

from loraplex.kernels import cpu_ops, native
from tests.utils.native_spy import LibSpy

if native.library() is None and not os.environ.get("CI"):
    pytest.skip("native CPU kernels unavailable (no C compiler)", allow_module_level=True)

INF, NAN = float("inf"), float("nan")
LAST_U = 1.0 - 2.0**-53  # the largest double below 1: the walk's far end


def uniforms(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(n, dtype=torch.float64, generator=gen)


@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("vocab", [5, 300, 49_152])
def test_matches_the_reference(spy: LibSpy, gen: torch.Generator, rows: int, vocab: int) -> None:
    x = torch.randn(rows, vocab, generator=gen) * 4
    x[:, ::7] = -INF  # masked tokens in every row (never token 1..6)
    x[:, 1] = 0.0  # at least one finite value
    wide = torch.full((rows, vocab + 3), 1e9)
    wide[:, 3:] = x
    view = wide[:, 3:]  # strided rows: the huge values left of the view must be ignored
    inv_temp = torch.rand(rows, generator=gen) * 2 + 0.25
    u = uniforms(rows, gen)
    out = cpu_ops.sample_rows(view, inv_temp, u)
    assert spy.calls == ["lp_sample_rows"]
    ref = cpu_ops.sample_rows_reference(x, inv_temp, u)
    # fp32 exps summed in another order may move a draw that lands within rounding of a boundary
    # to its neighbour; with these u that happens nowhere.
    assert out.tolist() == ref.tolist()
    assert not bool((x.gather(1, out.unsqueeze(1)) == -INF).any())


def test_frequencies_follow_the_softmax(spy: LibSpy, gen: torch.Generator) -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, -INF, 0.5, 3.0, -30.0])
    n = 200_000
    for temp in (0.5, 1.0, 2.0):
        probs = (logits / temp).softmax(-1)
        x = logits.expand(n, -1).contiguous()
        toks = cpu_ops.sample_rows(x, torch.full((n,), 1.0 / temp), uniforms(n, gen))
        freq = torch.bincount(toks, minlength=8).double() / n
        sd = (probs.double() * (1 - probs.double()) / n).sqrt()
        assert bool(((freq - probs.double()).abs() <= 5 * sd + 1e-12).all()), (temp, freq, probs)
        assert freq[4] == 0.0  # -inf: never
    assert set(spy.calls) == {"lp_sample_rows"}


@pytest.mark.parametrize("u", [0.0, 0.5, LAST_U])
def test_a_masked_token_is_never_drawn_at_either_end(spy: LibSpy, u: float) -> None:
    vocab = 49_152
    x = torch.full((3, vocab), -INF)
    x[0, 0] = 1.0  # only the first token
    x[1, vocab - 1] = 1.0  # only the last
    x[2, [5, 40_000]] = torch.tensor([1.0, -80.0])  # a second token far below the first
    out = cpu_ops.sample_rows(x, torch.ones(3), torch.full((3,), u, dtype=torch.float64))
    assert spy.calls == ["lp_sample_rows"]
    assert out.tolist()[:2] == [0, vocab - 1]
    assert out.tolist()[2] in (5, 40_000)


def test_rows_without_a_finite_largest_value_take_the_argmax(spy: LibSpy) -> None:
    x = torch.tensor(
        [
            [1.0, NAN, 5.0, 0.0],  # a NaN: the first NaN, as argmax
            [-INF, -INF, -INF, -INF],  # nothing finite: index 0
            [1.0, INF, 2.0, INF],  # +inf: the first +inf
            [0.0, 0.0, 0.0, 0.0],  # an ordinary row beside them: drawn (u = 0: the first)
        ]
    )
    u = torch.zeros(4, dtype=torch.float64)
    out = cpu_ops.sample_rows(x, torch.ones(4), u)
    assert spy.calls == ["lp_sample_rows"]
    assert out.tolist() == [1, 0, 1, 0]
    column_major = x.t().contiguous().t()  # a layout the kernel does not read: the torch path
    assert cpu_ops.sample_rows(column_major, torch.ones(4), u).tolist() == [1, 0, 1, 0]


def test_a_tiny_inverse_temperature_draws_uniformly(spy: LibSpy, gen: torch.Generator) -> None:
    n = 60_000
    x = torch.tensor([[10.0, 0.0, -10.0, -INF]]).expand(n, -1).contiguous()
    toks = cpu_ops.sample_rows(x, torch.full((n,), 1e-30), uniforms(n, gen))
    freq = torch.bincount(toks, minlength=4).double() / n
    assert bool(((freq[:3] - 1 / 3).abs() < 0.01).all()) and freq[3] == 0.0
    assert set(spy.calls) == {"lp_sample_rows"}


@pytest.mark.parametrize(
    "inv_temp,u", [(0.0, 0.5), (NAN, 0.5), (INF, 0.5), (1.0, 1.0), (1.0, -0.1), (1.0, NAN)]
)
def test_out_of_range_arguments_are_refused(inv_temp: float, u: float) -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="lp_sample_rows"):
        cpu_ops.sample_rows(
            x, torch.tensor([1.0, inv_temp]), torch.tensor([0.5, u], dtype=torch.float64)
        )


def test_inputs_the_kernel_cannot_read_use_the_reference(gen: torch.Generator) -> None:
    x = torch.randn(5, 64, generator=gen)
    inv_temp, u = torch.ones(5), uniforms(5, gen)
    ref = cpu_ops.sample_rows_reference(x, inv_temp, u)
    assert torch.equal(cpu_ops.sample_rows(x.t().contiguous().t(), inv_temp, u), ref)
    assert torch.equal(cpu_ops.sample_rows(x, inv_temp, u.float()), ref)  # fp32 uniforms
    nan_row = x.clone()
    nan_row[2, 3] = NAN
    got = cpu_ops.sample_rows(nan_row.double(), inv_temp, u)  # fp64 logits: the torch path
    assert got[2].item() == 3
