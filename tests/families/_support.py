"""The checks every model family passes, shared by the per-family test modules.

A family's test module makes a tiny random model with transformers (`make(directory, seed,
**overrides)`), then calls these: `convert_and_reference` (conversion + transformers' logits),
`logits_at_layout` (multi-rank: the converted and the HF load against transformers),
`train_and_export` (the CLI at 1 rank and PP2xEP2, PEFT export, `logits --adapter`), and the
`check_*` functions on its result. References are transformers' and PEFT's own models.
"""

import json
import os
import random
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare, parity
from tests.convert.tiny import make_tokens
from tests.export import _support as S
from tests.export import _inference as inference
from tests.harness import multirank
from tests.lora._bounds import judge  # logs |diff| / bound to $MEGATRON_LORA_MARGINS

FP64 = ".fp64"  # reference.safetensors: "<variant>" transformers' fp32 logits, "<variant>.fp64"
LR, ITERS = 2e-2, 3  # train_and_export's --lr and --train-iters
# The terms a trained adapter's gradient accumulates along its longest chain (fp32): 64 tokens
# per step, the 250-way softmax, and per layer (4) the 64 hidden columns, the widest
# projection (<= 96) and 16 keys
CHAIN = 64 + 250 + 4 * (64 + 96 + 16)
PROMPTS = [{"prompt": "hello there how are you"}, {"prompt": "the sky is blue"}]
NEW_TOKENS = 6
VOCAB = 250


def hf_model(directory: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(directory: str, tokens: torch.Tensor, adapter: str = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' eager logits [B, S, V] (with the PEFT adapter `adapter` if given), the
    model evaluated in `dtype` (fp64: the fp32 weights upcast exactly)."""
    model = hf_model(directory)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    return model.to(dtype)(tokens).logits.to(dtype)


def reference(ref: dict, name: str) -> tuple:
    """(fp32, fp64) transformers' logits of variant `name` from a reference.safetensors."""
    return ref[name], ref[name + FP64]


def perturb_norms(model) -> None:
    """Norm weights of 1 would hide a norm applied over the wrong axis, or not at all."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def add_extra_shard(directory: str, shapes: dict, name: str = "mtp.safetensors") -> None:
    """Write random tensors of `shapes` ({HF name: shape}) as one more shard of the HF folder,
    listed in its index: the layers a checkpoint holds after the decoder that transformers does
    not build (GLM-4.5's and DeepSeek-V3's multi-token-prediction layers)."""
    save_file({k: torch.randn(s) for k, s in shapes.items()}, os.path.join(directory, name))
    index_path = os.path.join(directory, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update({k: name for k in shapes})
    with open(index_path, "w") as f:
        json.dump(index, f)


def run(*args, nproc: int, port=None) -> subprocess.CompletedProcess:
    """`megatron-lora ARGS` under torchrun (also for one rank; a free port unless `port`);
    must succeed."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [*S.torchrun(nproc, port), "-m", "megatron_lora", *args]
    proc = subprocess.run(cmd, cwd=S.ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def convert_and_reference(root: str, make, variants: dict) -> dict:
    """For each variant name -> overrides: the HF folder `root/name` made by `make`; the first
    variant converted to `root/mcore`; token ids and transformers' logits of every variant in
    `root/reference.safetensors` (keys: the variant names, "<name>.fp64" for transformers'
    logits of the model evaluated in fp64, the measure of their fp32 rounding, and `tokens`)."""
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore

    paths = {"root": root}
    for i, (name, overrides) in enumerate(variants.items()):
        paths[name] = os.path.join(root, name)
        make(paths[name], seed=i, **overrides)
    first = next(iter(variants))
    paths["mcore"] = os.path.join(root, "mcore")
    hf_to_mcore(paths[first], paths["mcore"], progress=False)
    tokens = make_tokens(batch=2, seq=12, vocab=VOCAB)
    paths["tokens"] = S.write_tokens(os.path.join(root, "tokens.json"), tokens)
    paths["reference"] = os.path.join(root, "reference.safetensors")
    ref = {name + suffix: hf_logits(paths[name], tokens, dtype=dtype).contiguous()
           for name in variants for suffix, dtype in (("", torch.float32), (FP64, torch.float64))}
    save_file(dict(ref, tokens=tokens), paths["reference"])
    return paths


@multirank(world_size=lambda world_size, **_: world_size, timeout=600)
def logits_at_layout(layout, grouped, world_size, paths, variants):
    """At `layout` (grouped experts or not): the converted checkpoint of variants[0] and the HF
    load of every variant give transformers' logits within compare.reference_bound: 11 x
    transformers' own fp32 rounding on these tokens (measured against its fp64 evaluation)."""
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf, load_mcore
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.models.build import build_model, model_config

    ref = load_file(paths["reference"])

    def logits(name, from_mcore):
        info, hf, _ = open_hf(paths[name])
        model = build_model(info, model_config(info, layout), moe_grouped_gemm=grouped)
        load_mcore(model, paths["mcore"]) if from_mcore else load_hf(model, info, hf)
        return name, forward_logits(model, ref["tokens"], info.vocab_size)

    got = [logits(variants[0], True)] + [logits(name, False) for name in variants]
    if parity.assert_held_by(got[0][1], 1, "the logits"):
        for name, logit in got:
            assert logit.shape == ref[name].shape
            S.assert_near_reference(logit, reference(ref, name),
                                    f"{name} at {layout.describe()} vs transformers")


def text_data(path: str) -> str:
    rnd = random.Random(0)
    words = "hello there how are you the sky is blue fine thank colour lamp star".split()
    with open(path, "w") as f:
        for _ in range(16):
            f.write(json.dumps({"text": " ".join(rnd.choice(words) for _ in range(10))}) + "\n")
    return path


PP2_EP2 = ("run4", ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"], 4)
TP2_EP2_SP = ("run_tp", ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                         "--sequence-parallel"], 4)
TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")  # logits, generate


def train_and_export(paths: dict, hf: str, targets, extra=(),
                     layouts=(PP2_EP2,), infer=TP2_SP) -> dict:
    """The same LoRA run (3 steps, dropout 0.1, rsLoRA) at 1 rank (`run1`) and at each of
    `layouts` (PP2xEP2: `run4`); the PEFT export (`peft`) of the first layout's run (`exported`)
    and `logits --adapter` of it on 2 ranks with the flags `infer` (TP2+SP; `logits`), which
    check_generate uses too. The two runs are `train` commands under torchrun; logits and
    generate run the commands' computation in the warm 2-rank world (tests/export/_inference.py)."""
    from megatron_lora.export.to_peft import export_peft
    from tests.data.tiny_tokenizers import mistral_folder

    root = paths["root"]
    out = dict(paths, hf=hf, tok=mistral_folder(os.path.join(root, "tok"), vocab_size=VOCAB),
               infer=list(infer))
    data = text_data(os.path.join(root, "text.jsonl"))
    args = ["train", "--load-hf", hf, "--tokenizer", out["tok"], "--data-path", data,
            "--seq-length", "16", "--global-batch-size", "4", "--train-iters", str(ITERS),
            "--lr", str(LR),
            "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--lora-use-rslora",
            "--lora-target-modules", *targets, "--seed", "3", "--log-interval", "1", *extra]
    for name, flags, nproc in (("run1", [], 1), *layouts):
        out[name] = os.path.join(root, name)
        run(*args, *flags, "--save", out[name], nproc=nproc)
    out["peft"] = os.path.join(root, "peft")
    out["exported"] = out[layouts[0][0]]  # the run of the first layout
    export_peft(out["exported"], out["peft"], hf_config=hf)
    out["logits"] = os.path.join(root, "logits.safetensors")
    inference.logits(["--load-hf", hf, "--adapter", out["exported"], "--tokens", paths["tokens"],
                      "--out", out["logits"], *infer])
    return out


def adapter_tensors(run_dir: str) -> dict:
    from megatron_lora.convert.dcp_read import TorchDistCheckpoint
    from megatron_lora.training.checkpoint import resolve

    ckpt = TorchDistCheckpoint(resolve(run_dir))
    return {k: ckpt.read(k, (0,) * len(ckpt.shape(k)), ckpt.shape(k)) for k in ckpt.tensors
            if not k.startswith("optimizer.")}


TOKENS_PER_STEP = 64  # train_and_export: --global-batch-size 4 x --seq-length 16


def loss_bound(paths: dict, loss: float) -> float:
    """The most by which the loss `loss` of a step may differ between two layouts.

    Each layout's logits are within b = compare.reference_bound of transformers' fp32 logits
    (logits_at_layout checks it at these layouts: 11 x transformers' own fp32 rounding on the
    reference tokens, the same model, so rounding of the same size on the training tokens), so
    within 2 b of each other; a log-softmax moves by at most twice the largest change of its
    inputs, so each token's loss by 4 b; each side's log of a sum of VOCAB exponentials (all
    positive: relative rounding VOCAB u, so VOCAB u absolute in the log) and the mean over
    TOKENS_PER_STEP tokens (compare.sum_rounding_bound over that many terms of size <= loss)
    add their own rounding. At step 1 the adapter is B = 0 on both, the same model: the bound
    holds as derived. At steps 2 and 3 the adapters differ by Adam's moves of near-cancelling gradients (check_training_parity), whose
    effect on the loss is first order in their gradient, i.e. of rounding size. OLMoE: b =
    1.28e-5, the bound 1.2e-4 to 1.3e-4 on losses of ~5.5 (the former rel 1e-5: 5.5e-5); the
    layouts' losses differ by one fp32 ulp (4.8e-7) or not at all; a wrong gradient moves the
    loss of steps 2 and 3 by ~1e-3 (steps of lr 2e-2), and the adapter check catches it too."""
    b = compare.reference_bound(*reference(load_file(paths["reference"]), "hf"))
    mean = compare.sum_rounding_bound(torch.float32, TOKENS_PER_STEP,
                                      TOKENS_PER_STEP * abs(loss)) / TOKENS_PER_STEP
    softmax = 2 * VOCAB * compare.unit_roundoff(torch.float32)
    return 4 * b + softmax + mean


def check_losses(paths: dict, losses: list, expected: list, what: str) -> None:
    """`losses` (one per step) within loss_bound of `expected`, the one-rank run's."""
    assert len(losses) == len(expected) == ITERS, (losses, expected)
    bounds = torch.tensor([loss_bound(paths, x) for x in expected], dtype=torch.float64)
    failure = judge(torch.tensor(losses, dtype=torch.float64),
                    torch.tensor(expected, dtype=torch.float64), bounds,
                    f"{what}: losses per step (bound: loss_bound)")
    assert failure is None, failure


def check_training_parity(trained: dict, run: str = "run4") -> dict:
    """The run at another layout (`run`) gives the one-rank losses (within loss_bound) and
    adapter (see below); returns the adapter tensors."""
    from megatron_lora.training.logging import read_metrics

    losses = [[r["lm loss"] for r in read_metrics(os.path.join(trained[name], "metrics.jsonl"))
               if "lm loss" in r] for name in ("run1", run)]
    assert len(losses[0]) == 3 and losses[0][-1] < losses[0][0], losses
    check_losses(trained, losses[1], losses[0], f"{run} vs run1")
    one, other = adapter_tensors(trained["run1"]), adapter_tensors(trained[run])
    # Adam divides each step by the gradient's size: where an element's gradient cancels to
    # within its rounding, the other layout's summation order (DP/TP all-reduce, PP's stage
    # split, EP's token order) may send it the other way: up to 2 x 2e-2 x 1.0036 per step,
    # 0.12 in 3 steps (compare.adam_step_bound), the bound on every element. Elsewhere
    # (compare.adam_tight_bound) the gradient's rounding is at most CHAIN x u x 100 relative
    # where its terms add up to at most 100x its size, and Adam's ratio moves as much:
    # 1018 x 2**-24 x 100 x 0.12 = 7.3e-4. At most one element in a thousand per tensor
    # (and one in any tensor) may lie between the two (an element of an expert's A moved
    # by 2.55e-4 at PP2xEP2 on another machine, 2.9e-4 at TP2xEP2+SP). A wrong gradient,
    # reduction or shard moves most elements by whole steps of 2e-2.
    compare.assert_adam_trained_close(
        other, one, lrs=[LR] * ITERS, tight=compare.adam_tight_bound([LR] * ITERS, CHAIN),
        what=f"{run} vs run1")
    return one


def check_peft_logits(trained: dict) -> dict:
    """transformers + PEFT with the export give `logits --adapter`'s logits within
    compare.reference_bound (11 x transformers + PEFT's own fp32 rounding, measured against the
    same model in fp64); the adapter moves them by more than 100 x that bound, so the check sees
    it. Returns the config."""
    config = json.load(open(os.path.join(trained["peft"], "adapter_config.json")))
    tokens = torch.tensor(json.load(open(trained["tokens"])))
    ours = load_file(trained["logits"])["logits"]
    peft = S.in_both(hf_logits, trained["hf"], tokens, adapter=trained["peft"])
    bound = S.assert_near_reference(ours, peft, "logits --adapter vs transformers + PEFT")
    S.assert_moved(ours, hf_logits(trained["hf"], tokens), bound, "the adapter")
    return config


def check_import_is_bit_identical(trained: dict, out: str) -> None:
    """import peft of the export gives back the exported run's adapter bit for bit (the real vocabulary rows:
    padded rows are not exported)."""
    from megatron_lora.export.from_peft import import_peft

    import_peft(trained["peft"], out, hf_config=trained["hf"])
    original, back = adapter_tensors(trained["exported"]), adapter_tensors(out)
    assert sorted(original) == sorted(back)
    real = {"embedding.word_embeddings.lora_A": (slice(None), slice(0, VOCAB)),  # [r, Vp]
            "output_layer.lora_B": (slice(0, VOCAB),)}  # [Vp, r]
    for key in original:
        a, b = (t[real.get(key, ())].contiguous() for t in (original[key], back[key]))
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key


@torch.no_grad()
def _peft_greedy(trained: dict):
    from peft import PeftModel
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained["tok"])
    model = PeftModel.from_pretrained(hf_model(trained["hf"]), trained["peft"]).eval()
    out = []
    for p in PROMPTS:
        ids, new = tok(p["prompt"]).input_ids, []
        for _ in range(NEW_TOKENS):
            new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
            if new[-1] == tok.eos_token_id:
                break
        out.append(new)
    return out


def check_generate(trained: dict, tmp: str) -> None:
    """Greedy `generate --adapter` at TP2+SP (train_and_export's `infer` flags; in the warm
    2-rank world) gives the tokens of a greedy loop over transformers + PEFT forwards."""
    prompts, out = os.path.join(tmp, "prompts.jsonl"), os.path.join(tmp, "out.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in PROMPTS)
    inference.generate(["--load-hf", trained["hf"], "--adapter", trained["exported"],
                        "--tokenizer", trained["tok"], "--prompts", prompts, "--out", out,
                        "--max-new-tokens", str(NEW_TOKENS), *trained["infer"]])
    rows = [json.loads(line) for line in open(out)]
    assert [r["token_ids"] for r in rows] == _peft_greedy(trained)


@multirank(world_size=2, timeout=600)
def structure_matches_megatron(paths, name, layout):
    """At `layout` (2 ranks) the model megatron builds for `name` has exactly the tensors of the
    conversion mapping (keys, global shapes, extra states), the shapes checks.expected_shapes
    gives, and the largest rank allocates the bytes the memory estimate says."""
    import math

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    from megatron_lora.convert.checks import expected_shapes, parameter_bytes_per_rank
    from megatron_lora.convert.mapping import extra_states, mcore_tensors
    from megatron_lora.families import read_hf_config
    from megatron_lora.models.build import build_model, model_config

    info = read_hf_config(paths[name])
    model = build_model(info, model_config(info, layout), use_te=False)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    sharded, _, _ = load_preprocess(model.sharded_state_dict(metadata={"dp_cp_group": group}))
    tensors, objects = {}, set()
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensor):
            tensors.setdefault(v.key, set()).add(tuple(v.global_shape))
        else:
            objects.add(v.unique_key)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (tensors, objects))  # a stage holds only its own tensors
    tensors = {k: s for t, _ in gathered for k, s in t.items()}
    objects = {o for _, objs in gathered for o in objs}
    mapped = {t.key: {t.shape} for t in mcore_tensors(info)}
    assert tensors == mapped
    assert objects == {o.unique_key for o in extra_states(info)}
    assert {k: {tuple(n for n, _ in dims)} for k, dims in expected_shapes(info).items()} == mapped
    held = list(model.parameters()) + [b for n, b in model.named_buffers()
                                       if n.endswith("router.expert_bias")]  # saved, fp32
    mine = torch.tensor(sum(p.numel() * p.element_size() for p in held))
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    assert parameter_bytes_per_rank(info, layout, torch.float32) == int(mine)
    total = sum(math.prod(t.shape) for t in mcore_tensors(info))
    assert parameter_bytes_per_rank(info, ParallelLayout(), torch.float32) == 4 * total
