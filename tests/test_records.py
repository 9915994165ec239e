"""The family's variations as data: each is named in its kernel's name, taught to the plan, handed by the record."""

import dataclasses

import pytest

from tmac.base.glue import VARIATIONS, GlueSpec
from tmac.models.family.arch import ARCHITECTURES
from tmac.models.family.llama import LlamaConfig
from tmac.models.run.decode import TAUGHT

pytestmark = pytest.mark.unit  # needs no compiler (make unit)

BASE = dict(isa="avx2", dim=96, n_heads=6, n_kv_heads=2, head_dim=16, ffn_dim=80, act="silu", sub_norms=False,
            act_quant=False)
AWAY = {bool: lambda d: not d, int: lambda d: 8, float: lambda d: 0.25}  # a value of each kind off its default


def test_each_glue_variation_changes_the_kernels_name_and_no_two_alike():
    names = {GlueSpec(**BASE).name}
    for f in VARIATIONS:
        names.add(GlueSpec(**BASE, **{f.name: AWAY[type(f.default)](f.default)}).name)
    assert len(names) == len(VARIATIONS) + 1
    pair = GlueSpec(**BASE, qkv_bias=True, window=True).name
    assert pair not in names and "_qb" in pair and "_win" in pair


def test_a_rotary_dim_of_the_whole_head_is_the_default_by_name_and_value():
    whole = GlueSpec(**BASE, rotary_dim=BASE["head_dim"])
    assert whole.rotary_dim == 0 and whole.name == GlueSpec(**BASE).name


def test_every_glue_variation_is_taught_from_a_config_field_and_only_config_fields_are_taught():
    config_fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    glue_fields = {f.name for f in dataclasses.fields(GlueSpec)}
    taught_to = {g for fields in TAUGHT.values() for g in fields}
    assert set(TAUGHT) <= config_fields
    assert taught_to <= glue_fields
    assert {f.name for f in VARIATIONS} <= taught_to


def test_a_records_fixed_variations_are_config_fields_it_hands_over():
    config_fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    for arch in ARCHITECTURES.values():
        flags = arch.config_flags()
        assert set(flags) <= config_fields and flags["arch"] == arch.name
        for name, value in flags.items():
            assert getattr(arch, name, arch.name) == value
    # a record away from the defaults hands that over (OLMo 2: no input norms, q and k normalized whole)
    olmo = ARCHITECTURES["olmo2"].config_flags()
    assert olmo["pre_norms"] is False and olmo["qk_norm_whole"] is True and olmo["post_norms"] is True
