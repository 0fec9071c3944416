"""megatron_lora/testing/compare.py: the bounds' values and what a failure says."""

import pytest
import torch

from megatron_lora.testing import compare


def test_adam_ratio_is_one_at_the_first_step_and_bounded_after():
    # step 1: m_hat / sqrt(v_hat) = g / |g|; Cauchy-Schwarz over the moments' weights after
    assert compare.adam_ratio_bound(1) == pytest.approx(1.0)
    assert compare.adam_ratio_bound(2) == pytest.approx(1.0013579, rel=1e-6)
    assert compare.adam_step_bound([2e-2] * 3) == pytest.approx(0.1202, rel=1e-3)
    # the bound is reached: a gradient history that follows the weights' ratio a_k / c_k
    b1, b2, t = 0.9, 0.999, 3
    a = [(1 - b1) * b1 ** (t - k) / (1 - b1 ** t) for k in range(1, t + 1)]
    c = [(1 - b2) * b2 ** (t - k) / (1 - b2 ** t) for k in range(1, t + 1)]
    g = [x / y for x, y in zip(a, c)]
    ratio = sum(x * y for x, y in zip(a, g)) / sum(y * z * z for y, z in zip(c, g)) ** 0.5
    assert ratio == pytest.approx(compare.adam_ratio_bound(t))


def test_rounding_bounds():
    assert compare.unit_roundoff(torch.float32) == 2 ** -24
    assert compare.sum_rounding_bound(torch.float64, 4, 2.0) == 2 * 4 * 2 ** -53 * 2.0
    # any two orders of a real sum stay within the bound
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    orders = [x.sum(), x.flip(0).sum(), x.sort().values.sum(), x.double().sum().float()]
    bound = compare.sum_rounding_bound(torch.float32, 1000, float(x.abs().sum()))
    assert max(abs(float(a - b)) for a in orders for b in orders) <= bound


def test_a_failure_names_the_worst_element_its_index_and_the_bound():
    want = torch.zeros(3, 4)
    got = want.clone()
    got[1, 2], got[2, 0] = 5e-3, 2e-3
    with pytest.raises(AssertionError, match=r"w: worst element \[1, 2\]: 0\.00499.*vs expected 0, "
                                             r"\|diff\| 5\.000e-03 > bound 1\.000e-03 \(2 of 12"):
        compare.assert_within(got, want, 1e-3, "w")
    compare.assert_within(got, want, 5e-3, "w")
    nan = torch.tensor([float("nan"), 1.0])
    compare.assert_within(nan, nan.clone(), 0)  # NaN where both are NaN
    with pytest.raises(AssertionError, match=r"worst element \[0\]: nan"):
        compare.assert_within(nan, torch.ones(2), 1.0)


def test_trained_tensors_allow_single_elements_up_to_adams_bound_only():
    lrs = [2e-2] * 3
    want = {"a": torch.zeros(10, 10)}
    one = {"a": want["a"].clone()}
    one["a"][3, 4] = 0.1  # one element whose gradient cancelled: within Adam's 0.12
    compare.assert_adam_trained_close(one, want, lrs, tight=1e-4)
    far = {"a": one["a"].clone()}
    far["a"][3, 4] = 0.2
    with pytest.raises(AssertionError, match=r"a \(Adam bound.*worst element \[3, 4\]"):
        compare.assert_adam_trained_close(far, want, lrs, tight=1e-4)
    row = {"a": want["a"].clone()}
    row["a"][5] = 1e-2  # a whole row half a step off: a wrong gradient, not rounding
    with pytest.raises(AssertionError, match=r"more than 1 elements over the tight bound"):
        compare.assert_adam_trained_close(row, want, lrs, tight=1e-4)


def test_reference_bound_is_k_plus_one_times_the_references_own_rounding():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, 300, generator=g), torch.randn(300, 8, generator=g)
    ref64 = w.double() @ x.double()
    ref32 = w @ x
    bound = compare.reference_bound(ref32, ref64)
    own = float((ref32.double() - ref64).abs().max())
    assert own > 0 and bound == pytest.approx((compare.K_ORDERS + 1) * own)
    # another fp32 order of the same products (column by column, reversed sums) stays within it
    other = torch.stack([(w.flip(1) * x[:, j].flip(0)).sum(1) for j in range(8)], dim=1)
    compare.assert_within(other, ref32, bound, "another order")
    # a wrong product (one weight off by 1% of its size) does not
    bad = w.clone()
    bad[3, 7] *= 1.01
    with pytest.raises(AssertionError, match=r"worst element \[3, "):
        compare.assert_within(bad @ x, ref32, bound, "wrong weight")
    # an exact reference still allows one rounding of the largest element per side
    exact = torch.tensor([1.0, 2.0])
    assert compare.reference_bound(exact, exact.double()) == (compare.K_ORDERS + 1) * 2 * 2 ** -24


def test_mean_loss_bound_covers_other_orders_of_the_forward_and_the_mean():
    g = torch.Generator().manual_seed(1)
    logits64 = torch.randn(256, 384, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, 384, (256,), generator=g)
    ce = torch.nn.functional.cross_entropy
    loss64 = ce(logits64, labels).reshape(1)
    loss32 = ce(logits64.float(), labels).reshape(1)
    bound = compare.mean_loss_bound(loss32, loss64, 256)
    # another fp32 order: tokens reversed, summed one by one
    other = ce(logits64.float().flip(0), labels.flip(0), reduction="none")
    total = torch.zeros((), dtype=torch.float32)
    for t in other:
        total = total + t
    compare.assert_within((total / 256).reshape(1), loss32, bound, "loss")
    # the bound is the reference's rounding (K + 1 times it, at least one rounding of the loss)
    # plus lam sqrt(tokens) u of the loss per order: about 1e-5 relative here
    u = 2 ** -24
    assert bound == pytest.approx(11 * max(abs(float(loss32) - float(loss64)), u * float(loss64))
                                  + 2 * 6 * 16 * u * float(loss32))
    assert bound < 2e-5 * float(loss32)  # a loss divided by 256 + 1 tokens (4e-3 off) fails
    with pytest.raises(AssertionError, match="worst element"):
        compare.assert_within(loss32 * 256 / 257, loss32, bound, "loss")
