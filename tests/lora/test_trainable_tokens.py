"""Trainable tokens (lora/trainable_tokens.py) equal a plain torch reference from the same global
weights: embedding rows and output-layer rows of the listed ids replaced by the deltas (PEFT's
TrainableTokensLayer), fp32, non-zero deltas different from the base rows, ids owned by both TP
ranks: embedding output, logits, gradients of both deltas (after the TP step of
finalize_model_grads) and of the output layer's input, at TP1, TP2 and TP2+SP, own and tied
weights. Existing tokens' embedding rows and logits are bit-identical to the base's, the base
weights get no gradient. Removing the output layer's [T, n] gradient all-reduce breaks the
comparison. In a tiny tied GPT at TP2+SP (apply_lora): one shared [n, h] tensor, logits equal the
plain model's with the rows written into its weight; tied embeddings over two pipeline stages
and ids past the padded vocabulary are refused on every rank. Training 3 steps at TP2+SP and PP2
gives the single-rank losses and trained rows."""

import pytest
import torch

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

V, H, SEQ, BATCH = 64, 16, 8, 2
NEW = (30, 61, 63)  # rank 0 owns 30, rank 1 owns 61 and 63 at TP2


def _run(tp: int, sp: bool, tied: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_lora.lora.trainable_tokens import wrap_trainable_tokens
    from tests.lora._support import finalize_tp_grads, shard

    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, tensor_model_parallel_size=tp,
        sequence_parallel=sp, use_cpu_initialization=True,
    )
    g = torch.Generator().manual_seed(3)
    w_emb = torch.randn(V, H, generator=g)
    w_out = w_emb if tied else torch.randn(V, H, generator=g)
    ids = torch.randint(0, 60, (BATCH, SEQ), generator=g)
    ids[0, 1], ids[1, 5], ids[0, 6], ids[1, 0] = NEW[0], NEW[1], NEW[2], NEW[1]
    g_emb = torch.randn(SEQ, BATCH, H, generator=g)
    h_out = torch.randn(SEQ, BATCH, H, generator=g)
    g_logits = torch.randn(SEQ, BATCH, V, generator=g)
    d_emb = torch.randn(len(NEW), H, generator=g)
    d_out = d_emb if tied else torch.randn(len(NEW), H, generator=g)

    emb = VocabParallelEmbedding(V, H, init_method=torch.nn.init.zeros_, config=config,
                                 reduce_scatter_embeddings=sp)
    out_layer = ColumnParallelLinear(H, V, config=config, init_method=torch.nn.init.zeros_,
                                     bias=False, gather_output=False,
                                     skip_weight_param_allocation=tied)
    with torch.no_grad():
        emb.weight.copy_(shard(w_emb, 0))
        if not tied:
            out_layer.weight.copy_(shard(w_out, 0))
    e_ad, o_ad = wrap_trainable_tokens(emb, out_layer, NEW, tied=tied)
    # initialised to the base rows (PEFT's init): a no-op adapter
    init_ok = torch.equal(e_ad.trainable_tokens_delta, w_emb[list(NEW)]) and torch.equal(
        o_ad.delta(), w_out[list(NEW)])
    with torch.no_grad():
        e_ad.trainable_tokens_delta.copy_(d_emb)
        if not tied:
            o_ad.trainable_tokens_delta.copy_(d_out)

    y = e_ad(ids)  # [s/t, b, h] under SP, else [b, s, h]
    y_base = emb(ids)
    ge = shard(g_emb, 0) if sp else g_emb.transpose(0, 1)
    x = (shard(h_out, 0) if sp else h_out).clone().requires_grad_(True)
    w_arg = {"weight": emb.weight} if tied else {}
    logits, _ = o_ad(x, **w_arg)
    with torch.no_grad():
        logits_base, _ = out_layer(x, **w_arg)
    ((y * ge).sum() + (logits * shard(g_logits, 2)).sum()).backward()
    finalize_tp_grads(e_ad, config)
    finalize_tp_grads(o_ad, config)

    # reference, and S: the same graph on the absolute values (fp64), for the bounds
    def reference(w_emb, w_out, d_emb, d_out, h_out, g_emb, g_logits):
        de = d_emb.clone().requires_grad_(True)
        do = de if tied else d_out.clone().requires_grad_(True)
        xr = h_out.clone().requires_grad_(True)
        index = torch.tensor(NEW)
        ry = w_emb.index_copy(0, index, de)[ids].transpose(0, 1)  # [s, b, h]
        rl = xr @ w_out.index_copy(0, index, do).t()
        ((ry * g_emb).sum() + (rl * g_logits).sum()).backward()
        return ry.detach(), rl.detach(), de.grad, do.grad, xr.grad

    leaves = (w_emb, w_out, d_emb, d_out, h_out, g_emb, g_logits)
    ry, rl, de_grad, do_grad, xr_grad = reference(*leaves)
    s_y, s_l, s_de, s_do, s_x = reference(*(t.double().abs() for t in leaves))
    index = torch.tensor(NEW)
    want_y = shard(ry, 0) if sp else ry.transpose(0, 1)
    checks = {
        "embedding.output": (y, want_y, shard(s_y, 0) if sp else s_y.transpose(0, 1)),
        "output_layer.logits": (logits, shard(rl, 2), shard(s_l, 2)),
        "embedding.grad_delta": (e_ad.trainable_tokens_delta.grad, de_grad, s_de),
        "output_layer.grad_input": (x.grad, shard(xr_grad, 0) if sp else xr_grad,
                                    shard(s_x, 0) if sp else s_x),
    }
    if not tied:
        checks["output_layer.grad_delta"] = (o_ad.trainable_tokens_delta.grad, do_grad, s_do)
    # A linear graph (row lookups, products, sums): each element within
    # tests/lora/_bounds.shadow_bound(n, S) of the reference, S the graph on |leaves| and n the
    # longest chain: a logit sums H products, an input gradient V (over TP ranks), a delta's
    # gradient the 2 SEQ x BATCH tokens of both heads (embedding and tied output), plus the
    # TP all-reduces' and finalize's few roundings
    from tests.lora._bounds import judge, shadow_bound

    n = H + V + 2 * SEQ * BATCH + 8
    bad = {k: why for k, (a, b, shadow) in checks.items()
           if (why := judge(a, b, shadow_bound(n, shadow), k))}
    # existing tokens: bit-identical rows and logits, no gradient for the base weights
    ids_local = ids.t() if sp else ids
    if sp:
        k, s_local = torch.distributed.get_rank(), SEQ // tp
        ids_local = ids_local[k * s_local:(k + 1) * s_local]
    old = ~torch.isin(ids_local, index)
    if not torch.equal(y[old], y_base[old]):
        bad["embedding.existing_rows"] = "changed"
    start = out_layer.output_size_per_partition * (torch.distributed.get_rank() if tp > 1 else 0)
    cols = [c for c in range(logits.shape[-1]) if c + start not in NEW]
    if not torch.equal(logits[..., cols], logits_base[..., cols]):
        bad["output_layer.existing_logits"] = "changed"
    if emb.weight.grad is not None or (not tied and out_layer.weight.grad is not None):
        bad["base.grad"] = "present"
    if not init_ok:
        bad["init"] = "not the base rows"
    return bad


@multirank(world_size=1, timeout=400)
def test_trainable_tokens_match_reference_tp1(layout=ParallelLayout(tp=1)):
    report = {f"tied={t}": b for t in (False, True) if (b := _run(1, False, t))}
    assert not report, report


@multirank(world_size=2, timeout=400)
def test_trainable_tokens_match_reference_tp2_and_sp(layout=ParallelLayout(tp=2)):
    from megatron_lora.lora import collectives as C
    from tests.lora._support import patched

    report = {}
    for sp in (False, True):
        for tied in (False, True):
            bad = _run(2, sp, tied)
            if bad:
                report[f"sp={sp}/tied={tied}"] = bad
    # the [T, n] gradient all-reduce of the output layer's new-token logits matters
    with patched(C._GradAllReduce, "backward", lambda ctx, grad: (grad, None)):
        broken = _run(2, False, False)
    if "output_layer.grad_input" not in broken or "output_layer.grad_delta" not in broken:
        report["no gradient all-reduce"] = f"went unnoticed: {broken}"
    assert not report, report


def test_token_ids_outside_the_padded_vocabulary_are_refused():
    from megatron_lora.lora.trainable_tokens import check_token_ids

    assert check_token_ids([3, 1], 4) == (3, 1)
    with pytest.raises(ValueError, match="--add-special-tokens"):
        check_token_ids([4], 4)
    with pytest.raises(ValueError, match="repeated"):
        check_token_ids([1, 1], 4)


def _gpt_logits(model, ids):
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, None)


@multirank(world_size=2, timeout=400)
def test_in_a_tied_gpt_the_tokens_equal_the_rows_written_into_the_base(
        layout=ParallelLayout(tp=2, sp=True)):
    """apply_lora(trainable_token_indices) in a tiny tied GPT at TP2+SP: one [n, h] tensor (the
    output layer uses the embedding's), logits equal those of the plain model with the rows
    written into its (shared) weight; base weights untouched."""
    from megatron_lora.lora.model import LoraConfig, apply_lora, get_adapter_params
    from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config
    from megatron_lora.testing import compare

    shape = tiny_moe_shape(num_layers=2, num_experts=None, tie_embeddings=True)
    model = build_gpt_model(shape, transformer_config(shape, layout))
    weight = model.embedding.word_embeddings.weight
    before = weight.detach().clone()
    ids_new = (3, 200, 255)  # rank 0 owns 3, rank 1 owns 200 and 255 (vocab 256 at TP2)
    apply_lora(model, LoraConfig(r=2, target_modules=["linear_qkv"], seed=1,
                                 trainable_token_indices=ids_new), verbose=False)
    deltas = [n for n in get_adapter_params(model) if n.endswith("trainable_tokens_delta")]
    assert deltas == ["embedding.word_embeddings.trainable_tokens_delta"], deltas
    emb, out = model.embedding.word_embeddings, model.output_layer
    assert out.delta() is emb.trainable_tokens_delta
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        emb.trainable_tokens_delta.copy_(torch.randn(3, shape.hidden_size, generator=g))
    ids = torch.randint(0, 256, (2, 8), generator=g)
    ids[0, 1], ids[1, 3], ids[1, 6] = 3, 200, 255
    ours = _gpt_logits(model, ids)
    assert torch.equal(weight, before)  # the base weight is never written
    # the plain model, with the rows written into its weight shard
    model.embedding.word_embeddings, model.output_layer = emb.base_layer, out.base_layer
    with torch.no_grad():
        start = emb.base_layer.vocab_start_index
        for j, i in enumerate(ids_new):
            if start <= i < emb.base_layer.vocab_end_index:
                weight[i - start] = emb.trainable_tokens_delta[j]
    plain = _gpt_logits(model, ids)
    # Everything before the output layer is the same computation; a logit is a dot product of
    # h hidden values, computed in another order (the tokens' rows apart, or in another GEMM
    # shape), whose absolute terms add up to at most |hidden| |row| (Cauchy-Schwarz), and the
    # final RMS norm leaves |hidden| <= sqrt(h) max |norm weight|: sum_rounding_bound
    h = shape.hidden_size
    hidden = h ** 0.5 * float(model.decoder.final_layernorm.weight.abs().max())
    row = torch.stack([weight.norm(dim=1).max(), emb.trainable_tokens_delta.norm(dim=1).max()])
    torch.distributed.all_reduce(row, op=torch.distributed.ReduceOp.MAX)  # every rank's rows
    row = float(row.max())
    compare.assert_within(ours, plain, compare.sum_rounding_bound(torch.float32, h, hidden * row),
                          "logits with the tokens vs with the rows written into the base")


@multirank(world_size=2, timeout=400)
def test_tied_embeddings_over_two_stages_are_refused_on_every_rank(
        layout=ParallelLayout(pp=2)):
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config

    shape = tiny_moe_shape(num_layers=2, num_experts=None, tie_embeddings=True)
    model = build_gpt_model(shape, transformer_config(shape, layout))
    with pytest.raises(ValueError, match="--add-special-tokens.*one pipeline stage"):
        apply_lora(model, LoraConfig(r=2, target_modules=["linear_qkv"],
                                     trainable_token_indices=(250,)), verbose=False)
    with pytest.raises(ValueError, match="--add-special-tokens"):  # past the padded vocabulary
        apply_lora(model, LoraConfig(r=2, target_modules=["linear_qkv"],
                                     trainable_token_indices=(256,)), verbose=False)


def test_the_vocabulary_grows_for_ids_past_the_padded_rows_only_from_hf():
    from megatron_lora.lora.trainable_tokens import info_for_tokens
    from megatron_lora.families import model_info
    from tests.convert.tiny import TINY_CONFIG

    info = model_info(dict(TINY_CONFIG, architectures=["MixtralForCausalLM"],
                                           model_type="mixtral"))  # vocab 250, padded to 256
    assert info_for_tokens(info, [250, 255]) is info  # padded rows: no growth
    grown = info_for_tokens(info, [250, 256])
    assert (grown.shape.vocab_size, grown.vocab_size) == (384, 250)
    with pytest.raises(ValueError, match="--add-special-tokens.*needs the base from --load-hf"):
        info_for_tokens(info, [256], load="ckpt")


# --- training: the same trained rows at every layout ----------------------------------------
TRAIN_IDS = (300, 301)  # rows past the tokens the data uses otherwise (0-258), in the 384 rows


def _train_tokens(layout, weights=None, dtype=torch.float32):
    """(losses, {name: trained trainable_tokens_delta}) of 3 steps on text using TRAIN_IDS, the
    model (base and adapters) in `dtype` (fp64: the fp32 weights upcast exactly)."""
    from megatron_lora.data import PackedDataset, Sample, pack_samples
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.training.loop import train
    from tests.training import _support as S

    rows = []
    for i in range(16):
        ids = [256, 300] + list(f"{i} squared is {i * i}.".encode()) + [301, 257]
        rows.append(Sample(ids, [1] * len(ids)))
    data = PackedDataset(pack_samples(rows, S.SEQ, pad_id=258), seed=5)
    m = S.model(layout, weights)
    apply_lora(m, LoraConfig(r=2, target_modules=["linear_proj"], seed=1,
                             trainable_token_indices=TRAIN_IDS), verbose=False)
    m.to(dtype)
    rows = {n: p for n, p in m.named_parameters() if n.endswith("trainable_tokens_delta")}
    initial = {n: p.detach().clone() for n, p in rows.items()}
    result = train([m], data, S.run_config(iters=3), S.optim(3), layout_name=layout.describe())
    moved = min(((p.detach() - initial[n]).abs().max().item() for n, p in rows.items()),
                default=0.0)
    assert moved > 1e-4, moved  # every row tensor on this rank trained
    return result.losses, {n: p.detach().clone() for n, p in rows.items()}


@multirank(world_size=1, timeout=300)
def _tokens_reference(directory, layout=ParallelLayout()):
    import os

    from megatron_lora.testing.reference import save_weights
    from tests.training import _support as S

    save_weights(S.model(layout), os.path.join(directory, "weights"))
    losses, deltas = _train_tokens(layout, os.path.join(directory, "weights"))
    # the same run in fp64 from the same start: its losses against the fp32 run's are the
    # reference's own rounding (forward and trained rows), see the loss check
    losses64, _ = _train_tokens(layout, os.path.join(directory, "weights"), torch.float64)
    torch.save({"losses": losses, "losses64": losses64, "deltas": deltas},
               os.path.join(directory, "result.pt"))


@pytest.fixture(scope="module")
def tokens_reference(tmp_path_factory):
    import os

    directory = str(tmp_path_factory.mktemp("tokens_reference"))
    _tokens_reference(directory=directory)
    return directory, torch.load(os.path.join(directory, "result.pt"))


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2)],
                         ids=["TP2+SP", "PP2"])
@multirank(world_size=2, timeout=300)
def test_trained_rows_and_losses_match_the_single_rank_run(layout, tokens_reference):
    """3 steps training the rows of ids 300, 301 (and LoRA on linear_proj) at TP2+SP and PP2 give
    the single-rank losses (compare.mean_loss_bound) and trained rows (Adam's bounds); the rows
    moved."""
    import os

    from megatron_lora.testing import compare
    from tests.training import _support as S

    directory, ref = tokens_reference
    losses, deltas = _train_tokens(layout, os.path.join(directory, "weights"))
    # each step's loss: a mean over at most global batch x SEQ token cross-entropies of a
    # forward through the rows the previous steps trained; the bound is the reference's own
    # rounding (its fp64 twin) and two orders of the mean (compare.mean_loss_bound)
    steps = sorted(ref["losses"])
    want = torch.tensor([ref["losses"][i] for i in steps], dtype=torch.float64)
    want64 = torch.tensor([ref["losses64"][i] for i in steps], dtype=torch.float64)
    bound = compare.mean_loss_bound(want, want64, S.run_config(iters=3).global_batch_size * S.SEQ)
    compare.assert_within(torch.tensor([losses[i] for i in steps], dtype=torch.float64), want,
                          bound, f"trainable-token losses at {layout.describe()}")
    assert deltas, "no trainable tokens on this rank"  # PP2: embedding first, output last
    # trained by Adam: S.assert_trained_like's bounds (a row element whose gradient cancels may
    # take a step the other way; the rest move by the rounding of their gradients)
    S.assert_trained_like(deltas, ref["deltas"], S.optim(3).lr, 3, layout.describe())
