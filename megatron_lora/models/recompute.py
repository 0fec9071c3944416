"""Activation recomputation with megatron-core's own settings, checked for LoRA models.

megatron-core recomputes activations when its TransformerConfig says so (Megatron-LM's flags):

- recompute_granularity="full": TransformerBlock keeps only the input [s, b, h] (this rank's
  sequence shard under SP) of each checkpointed chunk of layers and runs the chunk's forward
  again in backward (`tensor_parallel.checkpoint`). recompute_method "uniform" checkpoints every
  chunk of recompute_num_layers consecutive layers of the pipeline stage; "block" checkpoints
  the first recompute_num_layers layers of the stage, one by one, and keeps the rest.
- recompute_granularity="selective": only the submodules named in recompute_modules are
  recomputed: "core_attn" (the attention scores and probabilities [b, heads/tp, s, s], the
  default) and "moe" (the whole MoE layer: router, dispatch, experts, combine). megatron's other
  modules do not apply to these models or need Transformer Engine (`_NOT_HERE`).

Same numbers: megatron saves the CPU default generator, the CUDA one and the named tracker
streams before a checkpointed forward and restores them before recomputing it (on CPU through
runtime.cpu_compat's `recompute_rng`), so the recomputed forward draws the same LoRA dropout keys
(lora/dropout.py: one key per adapter forward from the input device's default generator, one per
MoE layer forward in the dispatcher wrapper of lora/token_route.py) and recomputes the same masks.

Same gradients: megatron's checkpoint is re-entrant, so the parameters inside a checkpointed
region get gradients only through its tensor inputs. With a frozen word embedding (LoRA) the
first stage's decoder input does not require grad, the checkpoint's output then does not either,
nor anything computed from it, and the adapters in recomputed regions would get no gradient at
all, without an error (full recomputation from the first layer: none; LoRA on the experts alone
with selective "moe": no MoE layer's input requires grad, no expert adapter gets one).
`require_decoder_input_grad(model)` (lora/input_grad.py) marks that input as requiring grad (one extra input gradient
[s, b, h] at the first layer); `build_gpt_model` installs it whenever the config recomputes
more than core attention (whose region holds no parameters, except with prefix tuning, whose
apply_prefix installs it whenever the config recomputes anything: lora/prefix.py). Later pipeline stages receive
their input with requires_grad already (p2p communication).

`recompute_problems(...)` checks the settings against a model's layers per pipeline stage
before anything is built, with messages naming the `megatron-lora train` flags.
"""

from __future__ import annotations

from typing import List, Optional, Sequence


GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")
# recompute_modules megatron-core offers and what this project's Mixtral models make of them.
MODULES = ("core_attn", "moe")
_NOT_HERE = {
    "layernorm": "megatron-core recomputes norms with CheckpointWithoutOutput, which calls "
                 "Transformer Engine's FP8 state even without FP8 (NameError without TE)",
    "mlp": "it recomputes dense MLPs and every Mixtral layer is an MoE layer",
    "moe_act": "it needs megatron's grouped-GEMM experts, not the SequentialMLP experts used here",
    "shared_experts": "Mixtral has no shared experts",
    "mla_up_proj": "Mixtral has no multi-latent attention",
}


def recompute_problems(granularity: Optional[str], method: Optional[str],
                       num_layers: Optional[int], modules: Optional[Sequence[str]],
                       layers_per_stage: int) -> List[str]:
    """Every problem of these settings for a model with `layers_per_stage` transformer layers on
    each pipeline stage (pure: every rank finds the same ones before any collective). The
    messages name the train flags --recompute-granularity, --recompute-method,
    --recompute-num-layers and --recompute-modules."""
    problems = []
    if granularity is not None and granularity not in GRANULARITIES:
        return [f"--recompute-granularity must be one of {', '.join(GRANULARITIES)}, got "
                f"{granularity!r}"]
    if method is not None and method not in METHODS:
        problems.append(f"--recompute-method must be one of {', '.join(METHODS)}, got {method!r}")
    if granularity != "full":
        got = ("no --recompute-granularity" if granularity is None
               else f"--recompute-granularity {granularity}")
        for flag, value in (("--recompute-method", method),
                            ("--recompute-num-layers", num_layers)):
            if value is not None:
                problems.append(f"{flag} applies to --recompute-granularity full only (got {got})")
    else:
        if method is None:
            problems.append("--recompute-granularity full needs --recompute-method uniform "
                            "(every chunk of --recompute-num-layers layers) or block (the first "
                            "--recompute-num-layers layers of each pipeline stage)")
        if num_layers is None:
            problems.append(f"--recompute-granularity full needs --recompute-num-layers N, "
                            f"1 <= N <= {layers_per_stage} (layers per pipeline stage)")
        elif not 1 <= num_layers <= layers_per_stage:
            problems.append(f"--recompute-num-layers {num_layers} must be in [1, "
                            f"{layers_per_stage}] (layers per pipeline stage)")
        elif method == "uniform" and layers_per_stage % num_layers:
            problems.append(f"--recompute-num-layers {num_layers} does not divide the "
                            f"{layers_per_stage} layers per pipeline stage, which "
                            "--recompute-method uniform splits into chunks of N layers")
    if modules is not None:
        if granularity != "selective":
            problems.append("--recompute-modules applies to --recompute-granularity selective "
                            "only")
        for name in modules:
            if name in _NOT_HERE:
                problems.append(f"--recompute-modules {name}: not available, {_NOT_HERE[name]}; "
                                f"choose from {', '.join(MODULES)}")
            elif name not in MODULES:
                problems.append(f"--recompute-modules {name!r}: unknown; choose from "
                                f"{', '.join(MODULES)}")
        if not modules:
            problems.append("--recompute-modules needs at least one module")
    return problems


def recompute_overrides(granularity: Optional[str], method: Optional[str],
                        num_layers: Optional[int],
                        modules: Optional[Sequence[str]]) -> dict:
    """TransformerConfig keyword arguments for these settings ({} when nothing is recomputed;
    selective without modules keeps megatron's default, core_attn)."""
    if granularity is None:
        return {}
    overrides = dict(recompute_granularity=granularity, recompute_method=method,
                     recompute_num_layers=num_layers)
    if modules:
        overrides["recompute_modules"] = list(modules)
    return overrides


def recomputes_parameters(config) -> bool:
    """True when `config` (a TransformerConfig) recomputes a region that holds parameters: full
    recomputation, or selective with a module other than core_attn."""
    granularity = getattr(config, "recompute_granularity", None)
    if granularity == "full":
        return True
    if granularity == "selective":
        return any(m != "core_attn" for m in (config.recompute_modules or ["core_attn"]))
    return False


