"""A field absent from config.json means what it means to transformers' config class for that
model_type (families/hf_defaults.py): for every family and every field its reader reads, the
config without the field reads as the config transformers' class makes of it (the class's
`to_dict()`, which is what `save_pretrained` writes), and each table entry is the installed
class's `__init__` default."""

import dataclasses
import importlib
import inspect

import pytest

from megatron_lora.families import FAMILIES, ModelConfigError, model_info

SKIP = ("architectures", "model_type")


class Recording(dict):
    """A config dict that notes every field a reader looks at."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = set()

    def get(self, key, *a):
        self.seen.add(key)
        return super().get(key, *a)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)


def tiny_configs() -> dict:
    """{family name: the tiny config.json dict its test module builds models from}."""
    out = {}
    for name in ("qwen3_moe", "qwen2_moe", "olmoe", "gpt_oss", "glm4_moe", "deepseek_v3"):
        out[name] = importlib.import_module(f"tests.families.test_{name}").CONFIG
    out["mixtral"] = importlib.import_module("tests.families.test_mixtral").BASE
    v3 = importlib.import_module("tests.families.test_deepseek_v3")
    out["deepseek_v2"] = dict(v3.CONFIG, **v3.V2)
    return out


def config_class(model_type: str):
    from transformers import AutoConfig

    return type(AutoConfig.for_model(model_type))


def saved(model_type: str, cfg: dict) -> dict:
    """config.json as transformers writes it for `cfg` (absent fields filled by its class)."""
    return config_class(model_type)(**{k: v for k, v in cfg.items() if k != "model_type"}
                                    ).to_dict()


def read(cfg: dict):
    try:
        info = model_info(cfg)
        return dict(dataclasses.asdict(info.shape), vocab=info.vocab_size, dtype=info.dtype)
    except ModelConfigError:
        return "refused"


def difference(ours, want) -> str:
    if isinstance(ours, str) or isinstance(want, str):
        return f"ours {str(ours)[:200]}, transformers' {str(want)[:200]}"
    return ", ".join(f"{k}: ours {ours[k]!r}, transformers' {want[k]!r}"
                     for k in ours if ours[k] != want[k])


CONFIGS = tiny_configs()


def fields_read(model_type: str) -> list:
    full = Recording(saved(model_type, CONFIGS[model_type]))
    model_info(full)
    return sorted(k for k in full.seen if k not in SKIP)


def test_every_family_has_a_tiny_config_here():
    assert sorted(CONFIGS) == sorted(f.name for f in FAMILIES)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_a_missing_field_reads_as_transformers_class_makes_it(model_type):
    full = saved(model_type, CONFIGS[model_type])
    wrong, compared = [], 0
    for name in fields_read(model_type):
        if name not in full:
            continue
        without = {k: v for k, v in full.items() if k != name}
        try:
            theirs = saved(model_type, without)
        except Exception:  # the class itself refuses the config without it: nothing to compare
            continue
        compared += 1
        ours, want = read(without), read(theirs)
        if ours != want:
            wrong.append(f"{name} absent: {difference(ours, want)}")
    assert compared >= 10, compared
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_defaults_table_is_the_installed_config_class(model_type):
    family = next(f for f in FAMILIES if f.name == model_type)
    cls = config_class(model_type)
    signature = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    aliases = {v: k for k, v in getattr(cls, "attribute_map", {}).items()}
    for name, value in family.hf_defaults.items():
        key = name if name in signature else aliases.get(name)
        assert key in signature, f"{cls.__name__} has no field {name!r}"
        assert signature[key] == value, (name, signature[key], value)
    missing = [n for n in fields_read(model_type) if n in signature and n not in
               family.hf_defaults and n not in ("rope_parameters",)]
    assert not missing, f"{cls.__name__} defaults read but not in the table: {missing}"
