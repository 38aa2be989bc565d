"""Allocator-config parsing, checked against the rules in c10/core/AllocatorConfig.cpp."""

import pytest

from memfit.allocator.conf import AllocConf, alloc_conf_from_env, parse_alloc_conf
from memfit.errors import MemfitError
from memfit.units import GiB, MiB


def test_typical_string():
    conf = parse_alloc_conf("max_split_size_mb:128, expandable_segments:True")
    assert conf.max_split_size_bytes == 128 * MiB
    assert conf.expandable_segments is True
    assert conf.garbage_collection_threshold is None
    assert conf.roundup_power2_divisions == (0,) * 16


def test_empty_is_default():
    assert parse_alloc_conf("") == AllocConf()
    assert parse_alloc_conf(None) == AllocConf()


def test_max_split_size_minimum_is_20_mib():
    # parseMaxSplitSize: val >= kLargeBuffer / kMB = 20
    assert parse_alloc_conf("max_split_size_mb:20").max_split_size_bytes == 20 * MiB
    with pytest.raises(MemfitError, match="`19`"):
        parse_alloc_conf("max_split_size_mb:19")
    with pytest.raises(MemfitError, match="`abc`"):
        parse_alloc_conf("max_split_size_mb:abc")


def test_max_non_split_rounding():
    assert parse_alloc_conf("max_non_split_rounding_mb:64").max_non_split_rounding_bytes == 64 * MiB
    with pytest.raises(MemfitError):
        parse_alloc_conf("max_non_split_rounding_mb:10")


def test_gc_threshold_open_interval():
    assert parse_alloc_conf("garbage_collection_threshold:0.6").garbage_collection_threshold == 0.6
    for bad in ("0", "1.0", "1.5", "x"):
        with pytest.raises(MemfitError, match=f"`{bad}`"):
            parse_alloc_conf(f"garbage_collection_threshold:{bad}")


def test_bools_are_capitalised():
    with pytest.raises(MemfitError, match="`true`"):
        parse_alloc_conf("expandable_segments:true")
    assert parse_alloc_conf("expandable_segments:False").expandable_segments is False


def test_unknown_key_and_syntax_errors():
    with pytest.raises(MemfitError, match="`max_split_size`"):
        parse_alloc_conf("max_split_size:128")
    with pytest.raises(MemfitError, match="`:`"):
        parse_alloc_conf("max_split_size_mb")
    with pytest.raises(MemfitError, match="`,`"):
        parse_alloc_conf("max_split_size_mb:128:3")
    with pytest.raises(MemfitError, match="`weird`"):
        parse_alloc_conf("backend:weird")


def test_roundup_single_value_must_be_power_of_two():
    assert parse_alloc_conf("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16
    with pytest.raises(MemfitError, match="`3`"):
        parse_alloc_conf("roundup_power2_divisions:3")


def test_roundup_interval_list():
    # boundary 256 -> index log2(256)=8: indices 0..8 get 1 (first value fills below);
    # 512 -> index 9 = 2; 1024 -> index 10 = 4; '>' fills 11..15 with 8.
    conf = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert conf.roundup_power2_divisions == (1,) * 9 + (2, 4) + (8,) * 5
    assert conf.divisions_for(300 * MiB) == 1  # log2 = 28 -> index 28 - 20 = 8
    assert conf.divisions_for(600 * MiB) == 2  # index 9
    assert conf.divisions_for(1536 * MiB) == 4  # index 10
    assert conf.divisions_for(4 * GiB) == 8  # index 12
    assert conf.divisions_for(1000) == 1  # below 1 MiB -> index 0
    with pytest.raises(MemfitError, match="`3`"):
        parse_alloc_conf("roundup_power2_divisions:[3:1]")
    with pytest.raises(MemfitError, match="closing"):
        parse_alloc_conf("roundup_power2_divisions:[256:1")


def test_ignored_options_leave_notes():
    conf = parse_alloc_conf("release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True")
    assert conf == AllocConf()
    assert len(conf.notes) == 2


def test_env_precedence():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    conf = alloc_conf_from_env(env)  # AcceleratorAllocatorConfig::instance reads PYTORCH_ALLOC_CONF first
    assert conf.expandable_segments and conf.max_split_size_bytes is None
    assert alloc_conf_from_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}).max_split_size_bytes == 64 * MiB
    assert alloc_conf_from_env({}) == AllocConf()
