"""Parallel layouts: what a (tp, pp, ep, etp, sp) choice means and whether it fits a world.

Validation is pure Python on integers that every rank already knows, so every rank reaches the
same verdict without talking to the others: a bad layout raises the same error on every rank
before the first collective, and nobody is left waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


class LayoutError(ValueError):
    """A parallel layout that does not fit the world or the model; lists every problem found."""

    def __init__(self, problems: List[str]):
        self.problems = list(problems)
        super().__init__("invalid parallel layout:\n  - " + "\n  - ".join(self.problems))


# Megatron-LM's flag for each layout field (the CLI's names in error messages).
CLI_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
             "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size",
             "sp": "--sequence-parallel"}


class _namer:
    """How problems() names the layout's settings: field names, or the CLI's flags."""

    def __init__(self, layout, flags: bool):
        self.layout, self.flags = layout, flags

    def _get(self, field):
        return self.layout.expert_tp if field == "etp" else getattr(self.layout, field)

    def name(self, field: str) -> str:
        return CLI_FLAGS[field] if self.flags else field

    def value(self, field: str) -> str:  # tp=2 / --tensor-model-parallel-size 2
        return f"{self.name(field)}{' ' if self.flags else '='}{self._get(field)}"

    def on(self, field: str) -> str:  # sp=True / --sequence-parallel
        return CLI_FLAGS[field] if self.flags else f"{field}=True"

    def product(self, *fields: str) -> str:  # tp*pp = 2*1 = 2
        sep = " x " if self.flags else "*"
        total = 1
        for f in fields:
            total *= self._get(f)
        return (f"{sep.join(self.name(f) for f in fields)} = "
                f"{sep.join(str(self._get(f)) for f in fields)} = {total}")


@dataclass(frozen=True)
class ParallelLayout:
    """How a model is split over ranks. Field names follow Megatron-LM's flags.

    tp: tensor-model-parallel size (dense layers).
    pp: pipeline-model-parallel size.
    ep: expert-model-parallel size.
    etp: expert-tensor-parallel size (None: same as tp, megatron's default).
    sp: sequence parallelism (needs tp > 1 to mean anything).
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: Optional[int] = None
    sp: bool = False

    def __post_init__(self):
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError([f"{name} must be a positive integer, got {value!r}"])
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise LayoutError([f"etp must be a positive integer or None, got {self.etp!r}"])

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // self.model_parallel_size

    def problems(
        self,
        world_size: int,
        *,
        num_layers: Optional[int] = None,
        num_attention_heads: Optional[int] = None,
        num_query_groups: Optional[int] = None,
        num_experts: Optional[int] = None,  # 0: a dense model; None: not checked
        ffn_hidden_size: Optional[int] = None,
        moe_ffn_hidden_size: Optional[int] = None,
        expert_biases: bool = False,
        flags: bool = False,
    ) -> List[str]:
        """Every reason this layout cannot run on `world_size` ranks for a model of these sizes.

        flags: name the settings by these command-line flags (CLI_FLAGS) instead of the field
        names (`tp=2` becomes `--tensor-model-parallel-size 2`)."""
        say = _namer(self, flags)
        out: List[str] = []
        mp = self.tp * self.pp
        if world_size % mp:
            out.append(f"world size {world_size} is not a multiple of {say.product('tp', 'pp')}")
        expert_mp = self.ep * self.expert_tp * self.pp
        if world_size % expert_mp:
            out.append(f"world size {world_size} is not a multiple of "
                       f"{say.product('ep', 'etp', 'pp')}")
        if self.sp and self.tp == 1:
            out.append(f"sequence parallelism ({say.name('sp')}) needs {say.name('tp')} > 1")
        if num_layers is not None and num_layers % self.pp:
            out.append(f"{say.value('pp')} does not divide num_layers={num_layers}")
        if num_attention_heads is not None and num_attention_heads % self.tp:
            out.append(f"{say.value('tp')} does not divide num_attention_heads={num_attention_heads}")
        if num_query_groups is not None and num_query_groups % self.tp:
            out.append(f"{say.value('tp')} does not divide num_query_groups={num_query_groups}")
        if num_experts == 0 and self.ep > 1:
            out.append(f"{say.value('ep')} needs a model with experts (this model has none)")
        elif num_experts:
            if num_experts % self.ep:
                out.append(f"{say.value('ep')} does not divide num_experts={num_experts}")
            if self.tp > 1 and not self.sp:
                out.append(f"MoE with {say.name('tp')} > 1 needs sequence parallelism "
                           f"({say.on('sp')}) in megatron-core")
        if ffn_hidden_size is not None and ffn_hidden_size % self.tp:
            out.append(f"{say.value('tp')} does not divide ffn_hidden_size={ffn_hidden_size}")
        if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % self.expert_tp:
            out.append(
                f"{say.value('etp')} does not divide moe_ffn_hidden_size={moe_ffn_hidden_size}"
            )
        if expert_biases and self.expert_tp > 1:
            # megatron's expert MLP adds the fc2 bias to every expert-TP rank's partial sum
            # (megatron-core asserts ETP 1 for biased experts).
            out.append(f"experts with biases need {say.name('etp')}{' ' if flags else '='}1, got "
                       f"{self.expert_tp}"
                       + (" (it defaults to the tensor-parallel size)" if self.etp is None
                          else ""))
        return out

    def validate(self, world_size: int, flags: bool = False, **model_sizes) -> None:
        """Raise LayoutError listing every problem; identical on every rank, no communication."""
        problems = self.problems(world_size, flags=flags, **model_sizes)
        if problems:
            raise LayoutError(problems)

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """Parse names like "TP2xEP2+SP", "PP2xEP2", "TP2xPP2xEP2xETP1+SP", "TP1"."""
        import re

        body, _, suffix = text.strip().upper().partition("+")
        if suffix not in ("", "SP"):
            raise LayoutError([f"cannot parse layout {text!r}: unknown suffix +{suffix}"])
        sizes = {}
        for part in body.split("X"):
            m = re.fullmatch(r"(ETP|TP|PP|EP)(\d+)", part)
            if not m:
                raise LayoutError(
                    [f"cannot parse layout {text!r}: expected parts like TP2, PP2, EP2, ETP1 "
                     f"joined by 'x', optionally ending in +SP"]
                )
            sizes[m.group(1).lower()] = int(m.group(2))
        return cls(sp=suffix == "SP", **sizes)

    def describe(self) -> str:
        parts = [f"{k}{v}" for k, v in (("TP", self.tp), ("PP", self.pp), ("EP", self.ep)) if v > 1]
        if self.etp is not None:  # explicit, even when 1: ETP1 under TP2 is a real choice
            parts.append(f"ETP{self.etp}")
        name = "x".join(parts) or "TP1"
        return name + ("+SP" if self.sp else "")
