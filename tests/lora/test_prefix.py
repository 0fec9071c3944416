"""Prefix tuning (lora/prefix.py) on a converted tiny Mixtral equals transformers + PEFT's
PREFIX_TUNING, run as a plain single-process autograd reference, at every layout.

Reference (no megatron, no project code): transformers' MixtralForCausalLM (eager, fp32) loaded
from the tiny HF checkpoint, wrapped by `peft.get_peft_model(PrefixTuningConfig(CAUSAL_LM, n=3,
prefix_projection=False/True))`, every prompt-encoder parameter set to seeded random non-zero
values. Five samples of lengths 7, 10, 5, 8 and 3 run one at a time (each its own sequence: the
reference knows nothing of packing), inputs_embeds a leaf with requires_grad; the loss is the mean
token cross-entropy over all their targets. Megatron's loss runs over the padded vocabulary
(250 -> 256), whose converted output rows are zero: the reference appends those six zero logits
before its cross-entropy (and the test checks that the model's padded logits are exactly 0).
Plain `.backward()` gives the gradients of PEFT's prompt-encoder parameters (embedding.weight
[n, L*2*td], or E, W1, b1, W2, b2 of the projection) and of the input embeddings.

Under test: the megatron model at a layout (load_hf, apply_lora(LoraConfig(num_virtual_tokens=3,
target_modules=()))), the same global values written into each rank's shards (PEFT's layer-l
slice [l*2*td:(l+1)*2*td] as [2, kv heads, head_dim], this TP rank's query groups), wrapped for
training (megatron DDP, finalize_pre_normalised_grads), the samples packed into two rows of 16
(pack_samples + inputs_labels_mask: block-diagonal mask, samples restart at position n) and run
by training.step.forward_backward (one row per micro-batch; at one rank also both rows in one).
Compared (fp32; each quantity within compare.reference_bound of it, the reference evaluated
again in fp64 on the same inputs: see _bounds):
  - the global mean loss (every rank);
  - logits of every input token of every sample over the real vocabulary (last stage, by rows);
  - the gradient of every prefix parameter, gathered over TP (each stage its own layers; the
    shared E, W1, b1 on every rank: the TP x PP sum of reduce_shared_prefix_grads);
  - the gradient w.r.t. the input embeddings (first stage, gathered over the SP shards), zero on
    each sample's last token and on padding;
  - forward-only logits of an unpacked batch (no attention mask: the causal path) via
    convert.logits.forward_logits against PEFT's batched forward.
Every row, layer and parameter is checked on some rank (coverage is asserted). Layouts: one rank;
TP2+SP, PP2 and EP2 (DP2 for the prefix) on two ranks; TP2xPP2xEP2(ETP1)+SP on four; with and
without projection. A permanent negative control: at TP2+SP without reduce_shared_prefix_grads
the shared projection gradients are wrong (and only they).
"""

import json
import os

import pytest
import torch

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

N_VIRTUAL = 3
ENC = 24  # encoder_hidden_size: differs from td = 2 * 16 = 32, so a transposed W1 cannot fit
SEED = 17
SEQ = 16  # packed rows of SEQ + 1 tokens: [7, 10] fills row 0, [5, 8, 3] + 1 pad is row 1
LENGTHS = (7, 10, 5, 8, 3)
VOCAB, PADDED = 250, 256
UNPACKED = (2, 10)  # the forward-only batch: 2 samples of 10 tokens (SP: even), no attention mask
OWN = ("prefix_kv", "prefix_proj_weight", "prefix_proj_bias")  # per-layer [layers, ...]


def _samples():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _unpacked_tokens():
    return torch.randint(0, VOCAB, UNPACKED, generator=torch.Generator().manual_seed(12))


# --- the reference: transformers + PEFT, one process, plain autograd -------------------------
def _hf_reference(hf_dir: str, projection: bool, dtype=torch.float32) -> dict:
    import torch.nn.functional as F
    from peft import PrefixTuningConfig, get_peft_model
    from transformers import MixtralForCausalLM

    model = MixtralForCausalLM.from_pretrained(
        hf_dir, attn_implementation="eager", experts_implementation="eager", dtype=dtype)
    model.eval()
    cfg = PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N_VIRTUAL,
                             prefix_projection=projection, encoder_hidden_size=ENC)
    peft_model = get_peft_model(model, cfg)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    kv, layers = c.num_key_value_heads, c.num_hidden_layers
    td = kv * head_dim
    # PEFT's GQA prefix: token_dim = kv heads x head_dim, one "attention head" per kv head
    assert (peft_model.peft_config["default"].token_dim,
            peft_model.peft_config["default"].num_attention_heads) == (td, kv)
    enc = peft_model.prompt_encoder["default"].to(dtype)
    g = torch.Generator().manual_seed(SEED + projection)
    with torch.no_grad():
        for p in enc.parameters():  # non-zero, distinct, O(1) keys and values
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    params = dict(enc.named_parameters())
    out = {}
    total, count = 0.0, 0
    embed = model.get_input_embeddings()
    for i, ids in enumerate(_samples()):
        ids = torch.tensor(ids)
        x = embed(ids[:-1].unsqueeze(0)).detach().requires_grad_(True)
        logits = peft_model(inputs_embeds=x).logits[0]  # [L-1, 250]
        assert logits.dtype == dtype
        padded = torch.cat([logits, logits.new_zeros(logits.shape[0], PADDED - VOCAB)], -1)
        total = total + F.cross_entropy(padded, ids[1:], reduction="sum")
        count += len(ids) - 1
        out[f"logits/{i}"] = logits.detach()
        out[f"x/{i}"] = x
    loss = total / count
    loss.backward()
    for i in range(len(LENGTHS)):
        out[f"grad_x/{i}"] = out.pop(f"x/{i}").grad[0].clone()
    out["loss"] = loss.detach().reshape(1)
    # PEFT's parameters, in megatron's layout (layer l's [2, groups, head_dim] per token)
    shape = (layers, 2, kv, head_dim)
    if not projection:
        w = params["embedding.weight"]  # [n, L*2*td]
        for tag, t in (("value", w.detach()), ("grad", w.grad)):
            out[f"{tag}/prefix_kv"] = t.reshape(N_VIRTUAL, *shape).transpose(0, 1).contiguous()
    else:
        pieces = {"embedding": params["embedding.weight"],  # [n, td]
                  "weight": params["transform.0.weight"],  # [enc, td]
                  "bias": params["transform.0.bias"],  # [enc]
                  "prefix_proj_weight": params["transform.2.weight"],  # [L*2*td, enc]
                  "prefix_proj_bias": params["transform.2.bias"]}  # [L*2*td]
        for name, p in pieces.items():
            for tag, t in (("value", p.detach()), ("grad", p.grad)):
                if name == "prefix_proj_weight":
                    t = t.reshape(*shape, ENC)
                elif name == "prefix_proj_bias":
                    t = t.reshape(shape)
                out[f"{tag}/{name}"] = t.contiguous()
    assert all(out[k].abs().max() > 0 for k in out if k.startswith("grad/"))
    # forward only, a batch without attention mask (PEFT's batched prefix)
    with torch.no_grad():
        tokens = _unpacked_tokens()
        out["unpacked/tokens"] = tokens
        out["unpacked/logits"] = peft_model(input_ids=tokens).logits
    return {k: v.detach().contiguous() for k, v in out.items()}


def _bounds(ref: dict, ref64: dict) -> dict:
    """{"bound/" + key: [bound]} of every compared quantity: compare.reference_bound of it
    ((K + 1) x transformers + PEFT's own fp32 rounding of it on these inputs, measured against
    the same reference in fp64; its router softmax stays fp32 there, which K covers), per
    layer for the per-layer parameters. The loss, a mean of per-token cross entropies, moves by
    at most 2 max |d logit| (log-softmax's bound), plus its own mean over the tokens in two
    orders (probabilistic, as compare.gradient_bound: 2 x 6 sqrt(tokens) u x the loss)."""
    from megatron_lora.testing.compare import reference_bound, unit_roundoff

    out = {}
    for key, value in ref.items():
        if key.startswith(("logits/", "grad_x/", "grad/")) or key == "unpacked/logits":
            per_layer = key.split("/")[-1] in OWN
            pairs = zip(value, ref64[key]) if per_layer else [(value, ref64[key])]
            out["bound/" + key] = torch.tensor([reference_bound(a, b) for a, b in pairs],
                                               dtype=torch.float64)
    tokens = sum(n - 1 for n in LENGTHS)
    logits = max(float(out[f"bound/logits/{i}"]) for i in range(len(LENGTHS)))
    mean = 2 * 6 * tokens ** 0.5 * unit_roundoff(torch.float32) * float(ref["loss"])
    out["bound/loss"] = torch.tensor([2 * logits + mean], dtype=torch.float64)
    return out


@pytest.fixture(scope="module")
def prefix_reference(tmp_path_factory):
    from safetensors.torch import save_file

    from tests.convert.tiny import make_tiny_mixtral

    root = tmp_path_factory.mktemp("prefix_reference")
    hf_dir = str(root / "hf")
    make_tiny_mixtral(hf_dir, seed=5)
    for projection in (False, True):
        ref = _hf_reference(hf_dir, projection)
        ref.update(_bounds(ref, _hf_reference(hf_dir, projection, torch.float64)))
        save_file(ref, str(root / f"ref_{int(projection)}.st"))
    return str(root)


# --- the model under test --------------------------------------------------------------------
def _packed():
    from megatron_lora.data import Sample, pack_samples
    from megatron_lora.data.packing import inputs_labels_mask

    rows = pack_samples([Sample(s, [1] * len(s)) for s in _samples()], SEQ, pad_id=0)
    assert rows.tokens.shape[0] == 2  # two rows: DP2 and two micro-batches under PP2
    return rows, inputs_labels_mask(rows.tokens, rows.targets, rows.sample_ids)


def _where(rows):
    """[(row, position, sample, index in the sample)] of every packed input position."""
    out = []
    for r in range(rows.sample_ids.shape[0]):
        start = {}
        for j in range(SEQ):
            sid = int(rows.sample_ids[r, j])
            start.setdefault(sid, j)
            out.append((r, j, sid, j - start[sid]))
    return out


def _gather(t, group, dim):
    import torch.distributed as dist

    size = dist.get_world_size(group=group)
    if size == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _diff(a, b, bound):
    """(max |a - b| / bound, the worst element, its index and the bound in words): over 1 the
    check fails; inf on a shape mismatch."""
    from megatron_lora.testing.compare import worst_element

    if a.shape != b.shape:
        return float("inf"), f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    worst = worst_element(a, b, float(bound))
    return (worst["diff"] / float(bound) if float(bound) else float("inf"),
            f"worst element {list(worst['index'])}: {worst['actual']:.9g} vs "
            f"{worst['expected']:.9g}, bound {float(bound):.3e}")


def _run_layout(layout, projection, ref_dir, micro_batch_size=1, skip_shared_reduce=False):
    """On every rank: {check name: relative max diff} of everything this rank can compare, and
    the names of the global quantities it covered."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.training import step
    from megatron_lora.training.optimizer import OptimConfig, wrap_for_training

    ref = load_file(os.path.join(ref_dir, f"ref_{int(projection)}.st"))
    info, hf, _ = open_hf(os.path.join(ref_dir, "hf"))
    model = build_model(info, model_config(info, layout))
    load_hf(model, info, hf)
    apply_lora(model, LoraConfig(num_virtual_tokens=N_VIRTUAL, target_modules=(),
                                 prefix_projection=projection,
                                 encoder_hidden_size=ENC if projection else None, seed=SEED),
               verbose=False)
    tp_group = ps.get_tensor_model_parallel_group()
    tp, k = tp_group.size(), tp_group.rank()
    groups = info.shape.num_query_groups
    part = slice(k * groups // tp, (k + 1) * groups // tp)
    # this stage's layers (megatron's global 1-based layer_number) and their prefix modules
    layers = {layer.layer_number - 1: layer.self_attention.core_attention
              for layer in model.decoder.layers}
    own = {"prefix_kv": 2} if not projection else {"prefix_proj_weight": 1, "prefix_proj_bias": 1}
    with torch.no_grad():
        for li, core in layers.items():
            for name, dim in own.items():
                getattr(core, name).copy_(ref[f"value/{name}"][li][(slice(None),) * dim + (part,)])
        if projection:
            for name in ("embedding", "weight", "bias"):
                getattr(model.prefix_encoder, name).copy_(ref[f"value/{name}"])
    result, covered = {}, set()

    # forward only, unpacked (attention_mask None): the causal path
    logits = forward_logits(model, ref["unpacked/tokens"], VOCAB)
    if logits is not None:
        result["unpacked.logits"] = _diff(logits, ref["unpacked/logits"],
                                          ref["bound/unpacked/logits"])
        covered.add("unpacked.logits")
    model.train()

    (wrapped,), _, _ = wrap_for_training([model], OptimConfig(lr=1e-3, train_iters=1))
    if skip_shared_reduce:  # the negative control: megatron's finalize alone
        from megatron.core.distributed import finalize_model_grads

        model.config.finalize_model_grads_func = (
            lambda chunks, num_tokens=None, **kw: finalize_model_grads(chunks, None, **kw))
    rows, (tokens, labels, loss_mask, mask) = _packed()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = rows.tokens.shape[0] // dp
    mine = range(dp_rank * per, (dp_rank + 1) * per)  # the global rows this DP rank runs
    seen_logits, seen_x = [], {}
    if model.post_process:
        model.output_layer.register_forward_hook(
            lambda m, a, o: seen_logits.append(_gather(o[0], tp_group, -1)))
    if model.pre_process:
        def leaf(module, args, output):
            x = output.detach().requires_grad_(True)
            index = len(seen_x)
            seen_x[index] = None
            x.register_hook(lambda g: seen_x.__setitem__(index, g.detach().clone()))
            return x

        model.embedding.register_forward_hook(leaf)
    loss = step.forward_backward([wrapped], tokens, labels, loss_mask, mask,
                                 micro_batch_size=micro_batch_size)
    result["loss"] = _diff(loss.reshape(1), ref["loss"], ref["bound/loss"])
    covered.add("loss")

    where = [w for w in _where(rows) if w[0] in mine]
    inputs = {}  # (sample, index) -> (local row, position) for each sample's input tokens
    for r, j, sid, t in where:
        if sid >= 0 and t < LENGTHS[sid] - 1:
            inputs[(sid, t)] = (r - mine[0], j)
    if model.post_process:
        assert len(seen_logits) == len(mine) // micro_batch_size
        got = torch.cat(seen_logits, dim=1).transpose(0, 1)  # [rows, s, Vp]
        padded_zero = got[..., VOCAB:].abs().max().item() == 0
        for sid in {s for s, _ in inputs}:
            idx = [inputs[(sid, t)] for t in range(LENGTHS[sid] - 1)]
            mine_l = torch.stack([got[r, j, :VOCAB] for r, j in idx])
            result[f"logits/{sid}"] = _diff(mine_l, ref[f"logits/{sid}"],
                                            ref[f"bound/logits/{sid}"])
            covered.add(f"logits/{sid}")
        if not padded_zero:
            result["logits.padded_columns_nonzero"] = float("inf")
    if model.pre_process:
        micro = len(mine) // micro_batch_size
        assert len(seen_x) == micro and all(g is not None for g in seen_x.values())
        sp_group = tp_group if model.config.sequence_parallel else None
        gx = [seen_x[i] if sp_group is None else _gather(seen_x[i], sp_group, 0)
              for i in range(micro)]
        gx = torch.cat(gx, dim=1).transpose(0, 1)  # [rows, s, h]
        zero = torch.ones(gx.shape[:2], dtype=torch.bool)
        for sid in {s for s, _ in inputs}:
            idx = [inputs[(sid, t)] for t in range(LENGTHS[sid] - 1)]
            for r, j in idx:
                zero[r, j] = False
            got = torch.stack([gx[r, j] for r, j in idx])
            result[f"grad_x/{sid}"] = _diff(got, ref[f"grad_x/{sid}"],
                                            ref[f"bound/grad_x/{sid}"])
            covered.add(f"grad_x/{sid}")
        # each sample's last token and padding reach no loss
        result["grad_x.elsewhere"] = (gx[zero].abs().max().item(), "max |gradient|, want 0")
    # the prefix parameters' gradients (megatron DDP's reduced main_grad), gathered over TP
    for li, core in layers.items():
        for name, dim in own.items():
            g = _gather(getattr(core, name).main_grad, tp_group, dim)
            result[f"grad/{name}/{li}"] = _diff(g, ref[f"grad/{name}"][li],
                                                 ref[f"bound/grad/{name}"][li])
            covered.add(f"grad/{name}/{li}")
    if projection:
        for name in ("embedding", "weight", "bias"):
            result[f"grad/{name}"] = _diff(getattr(model.prefix_encoder, name).main_grad,
                                           ref[f"grad/{name}"], ref[f"bound/grad/{name}"])
            covered.add(f"grad/{name}")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (result, sorted(covered)))
    return everyone


def _expected_coverage(projection):
    names = {"loss", "unpacked.logits"}
    names |= {f"{kind}/{i}" for kind in ("logits", "grad_x") for i in range(len(LENGTHS))}
    own = ("prefix_kv",) if not projection else ("prefix_proj_weight", "prefix_proj_bias")
    names |= {f"grad/{n}/{li}" for n in own for li in range(4)}
    if projection:
        names |= {f"grad/{n}" for n in ("embedding", "weight", "bias")}
    return names


def _check(layout, ref_dir, cases=((False, 1), (True, 1))):
    """cases: (prefix_projection, micro_batch_size) pairs."""
    import torch.distributed as dist

    report, measured = {}, {}
    for projection, mbs in cases:
        everyone = _run_layout(layout, projection, ref_dir, mbs)
        covered = set().union(*(set(c) for _, c in everyone))
        missing = _expected_coverage(projection) - covered
        if missing:
            report[f"projection={projection}/mbs={mbs}/not checked"] = sorted(missing)
        worst = {}
        for rank, (result, _) in enumerate(everyone):
            for name, (d, why) in result.items():
                worst[name] = max(worst.get(name, 0.0), d)
                # exact zeros where no loss reaches; elsewhere the ratio to the bound
                limit = 0.0 if name == "grad_x.elsewhere" else 1.0
                if not d <= limit:
                    report[f"projection={projection}/mbs={mbs}/rank{rank}/{name}"] = why
        measured[f"projection={projection}/mbs={mbs}"] = worst
    if dist.get_rank() == 0:  # the measured maxima, beside the reference (for the record)
        with open(os.path.join(ref_dir, f"measured_{layout.describe()}.json"), "w") as f:
            json.dump(measured, f, indent=1, sort_keys=True)
    assert not report, report


@multirank(world_size=1, timeout=300)
def test_prefix_tuning_matches_peft_on_one_rank(prefix_reference, layout=ParallelLayout()):
    # a micro-batch of both rows too: per-row positions [b, s] and masks [b, 1, s, n + s]
    _check(layout, prefix_reference, cases=((False, 1), (True, 1), (False, 2)))


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2),
                                    ParallelLayout(ep=2)], ids=["TP2+SP", "PP2", "EP2"])
@multirank(world_size=2, timeout=400)
def test_prefix_tuning_matches_peft_on_two_ranks(layout, prefix_reference):
    _check(layout, prefix_reference)


@multirank(world_size=4, timeout=400)
def test_prefix_tuning_matches_peft_on_four_ranks(
        prefix_reference, layout=ParallelLayout(tp=2, pp=2, ep=2, etp=1, sp=True)):
    _check(layout, prefix_reference, cases=((True, 1),))


@multirank(world_size=2, timeout=300)
def test_without_the_shared_reduction_the_projection_gradients_are_wrong(
        prefix_reference, layout=ParallelLayout(tp=2, sp=True)):
    everyone = _run_layout(layout, True, prefix_reference, skip_shared_reduce=True)
    for rank, (result, _) in enumerate(everyone):
        wrong = sorted(n for n, (d, _) in result.items()
                       if not d <= (0.0 if n == "grad_x.elsewhere" else 1.0))
        # each TP rank's E, W1, b1 gradient holds only its own query group's part
        assert wrong == ["grad/bias", "grad/embedding", "grad/weight"], (rank, result)
