"""Prefix tuning's fields of LoraConfig, checked on construction (lora/prefix.py builds the
prefixes; this module only validates the configuration)."""

from __future__ import annotations


def check_prefix_fields(config) -> bool:
    """LoraConfig's prefix-tuning fields validated (ValueError naming the field and the train
    flag); for a prefix config (num_virtual_tokens > 0) the LoRA fields are set empty. Returns
    whether `config` is a prefix-tuning config."""
    n = config.num_virtual_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"LoraConfig.num_virtual_tokens (--num-virtual-tokens) must be an "
                         f"integer >= 0, got {n!r}")
    if not isinstance(config.prefix_projection, bool):
        raise ValueError(f"LoraConfig.prefix_projection must be a bool, got "
                         f"{config.prefix_projection!r}")
    hidden = config.encoder_hidden_size
    if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int)
                               or hidden < 1):
        raise ValueError(f"LoraConfig.encoder_hidden_size (--prefix-encoder-hidden-size) "
                         f"must be a positive integer or None, got {hidden!r}")
    if not n:
        if config.prefix_projection or hidden is not None:
            raise ValueError("LoraConfig.prefix_projection / encoder_hidden_size need "
                             "num_virtual_tokens > 0 (--peft-type prefix)")
        return False
    if hidden is not None and not config.prefix_projection:
        raise ValueError("LoraConfig.encoder_hidden_size (--prefix-encoder-hidden-size) "
                         "needs prefix_projection (--prefix-projection)")
    targets = config.target_modules
    targets = [targets] if isinstance(targets, str) else list(targets or ())
    if targets or config.use_dora or config.trainable_token_indices:
        extra = [name for name, on in (("target_modules", bool(targets)),
                                        ("use_dora", config.use_dora),
                                        ("trainable_token_indices",
                                         bool(config.trainable_token_indices))) if on]
        raise ValueError(
            f"LoraConfig.num_virtual_tokens (prefix tuning, --peft-type prefix) cannot be "
            f"combined with {', '.join(extra)}: PEFT loads one adapter type per adapter, so "
            f"such a run could not be exported; pass target_modules=() (train: leave out "
            f"--lora-target-modules, --lora-use-dora and --add-special-tokens)")
    if config.rank_pattern or config.alpha_pattern:
        raise ValueError("LoraConfig.rank_pattern / alpha_pattern are LoRA settings; prefix "
                         "tuning (num_virtual_tokens > 0) takes none")
    object.__setattr__(config, "target_modules", ())
    object.__setattr__(config, "trainable_token_indices", ())
    object.__setattr__(config, "rank_pattern", {})
    object.__setattr__(config, "alpha_pattern", {})
    return True


__all__ = ["check_prefix_fields"]
