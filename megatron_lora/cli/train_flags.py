"""train's adapter flags: the prefix-tuning config they give, the flags a run type refuses, and
LoraConfig field names in messages turned into the flags that set them. `TrainSetupError` is what
every setup check raises: bad input found before training starts."""

from __future__ import annotations


class TrainSetupError(ValueError):
    """Bad input found before training started. `every_rank` False (the default): the same
    message on every rank, so the CLI prints it on rank 0 only; True: this rank's own (a bad
    file only this rank reads), printed by each rank that has it."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


# LoraConfig field -> the train flag that sets it, for messages about CLI input.
_LORA_FLAGS = {"LoraConfig.r": "--lora-rank", "LoraConfig.lora_alpha": "--lora-alpha",
               "LoraConfig.lora_dropout": "--lora-dropout",
               "LoraConfig.target_modules": "--lora-target-modules",
               "LoraConfig.rank_pattern": "--lora-rank-pattern",
               "LoraConfig.alpha_pattern": "--lora-alpha-pattern",
               "LoraConfig.dtype (--lora-dtype)": "--lora-dtype",
               "target_modules": "--lora-target-modules"}


_PREFIX_FLAGS = {"LoraConfig.num_virtual_tokens (--num-virtual-tokens)": "--num-virtual-tokens",
                 "LoraConfig.encoder_hidden_size (--prefix-encoder-hidden-size)":
                     "--prefix-encoder-hidden-size"}
# The adapter flags of LoRA runs (argparse dest -> flag): a prefix-tuning run refuses them.
LORA_ONLY_FLAGS = {"lora_rank": "--lora-rank", "lora_alpha": "--lora-alpha",
                   "lora_dropout": "--lora-dropout", "lora_target_modules": "--lora-target-modules",
                   "lora_use_rslora": "--lora-use-rslora", "lora_use_dora": "--lora-use-dora",
                   "lora_rank_pattern": "--lora-rank-pattern",
                   "lora_alpha_pattern": "--lora-alpha-pattern",
                   "add_special_tokens": "--add-special-tokens"}


def prefix_config(args):
    """The LoraConfig of a `--peft-type prefix` run; TrainSetupError naming the flags when LoRA
    flags were given too (PEFT could not load the combination) or the prefix flags are wrong."""
    from megatron_lora.lora.model import LoraConfig

    given = getattr(args, "given_flags", None) or ()
    mixed = [flag for dest, flag in LORA_ONLY_FLAGS.items() if dest in given]
    if mixed:
        raise TrainSetupError(
            f"--peft-type prefix trains key/value prefixes only; {', '.join(mixed)} "
            f"cannot be combined with it: PEFT loads one adapter type per adapter, so a run "
            f"with both could not be exported. Drop {', '.join(mixed)}, or use --peft-type lora")
    if args.num_virtual_tokens is None or args.num_virtual_tokens < 1:
        got = "" if args.num_virtual_tokens is None else f", got {args.num_virtual_tokens}"
        raise TrainSetupError(f"--peft-type prefix needs --num-virtual-tokens N >= 1 (the prefix "
                              f"length, e.g. 20){got}")
    if args.prefix_encoder_hidden_size is not None and not args.prefix_projection:
        raise TrainSetupError("--prefix-encoder-hidden-size needs --prefix-projection")
    try:
        return LoraConfig(target_modules=(), num_virtual_tokens=args.num_virtual_tokens,
                          prefix_projection=bool(args.prefix_projection),
                          encoder_hidden_size=args.prefix_encoder_hidden_size, seed=args.seed,
                          dtype=getattr(args, "lora_dtype", None) or "fp32")
    except ValueError as exc:
        message = str(exc)
        for field, flag in _PREFIX_FLAGS.items():
            message = message.replace(field, flag)
        raise TrainSetupError(message) from None


def refuse_prefix_flags(args) -> None:
    """The prefix flags without --peft-type prefix would be ignored: refused instead."""
    stray = [flag for flag, on in (
        ("--num-virtual-tokens", getattr(args, "num_virtual_tokens", None) is not None),
        ("--prefix-projection", getattr(args, "prefix_projection", False)),
        ("--prefix-encoder-hidden-size",
         getattr(args, "prefix_encoder_hidden_size", None) is not None)) if on]
    if stray:
        raise TrainSetupError(f"{', '.join(stray)}: prefix-tuning flags, used only with "
                              f"--peft-type prefix (without --lora-* flags); add it, or drop them")


def as_flags(message: str) -> str:
    """`message` with the first LoraConfig field it names replaced by its train flag."""
    for field, flag in _LORA_FLAGS.items():
        if message.startswith(field + " ") or f" {field} " in message:
            return message.replace(field, flag, 1)
    return message
