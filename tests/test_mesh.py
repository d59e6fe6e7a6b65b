"""Mesh presets against the facts in shared/notes (tt-plugin-contract.md, ttnn-host.md)."""

from __future__ import annotations

import re

import pytest

from ttbundle import mesh as meshmod
from ttbundle.errors import InvalidInput

# tt-plugin-contract.md, "MESH_DEVICE presets (plugin table)"; TG: "worker opens (8,4)".
PLUGIN_SHAPES = {
    "N150": (1, 1), "P100": (1, 1), "P150": (1, 1),
    "N300": (1, 2), "P300": (1, 2), "P150x2": (1, 2),
    "N150x4": (1, 4), "P150x4": (1, 4), "P300x2": (1, 4),
    "T3K": (1, 8), "P150x8": (1, 8),
    "TG": (8, 4),
}
# ttnn-host.md topologies: single_bh_galaxy 8x4, dual_galaxy 8x8 (2 hosts), quad_galaxy 8x16 (4 hosts).
GALAXIES = {"BH-Galaxy": ((8, 4), 1, "blackhole"), "DUAL_GALAXY": ((8, 8), 2, "wormhole_b0"),
            "QUAD_GALAXY": ((8, 16), 4, "wormhole_b0")}
WORMHOLE_NAMES = {"N150", "N300", "N150x4", "T3K", "TG"}
# ttnn-host.md "Device facts": allocator banks x bytes, L1 banks x bytes, DRAM alignment.
WH_DRAM = 12 * 1_072_693_184
BH_DRAM = 8 * 4_277_141_376
WH_L1 = 64 * 1_393_312
BH_L1 = 130 * 1_461_120


@pytest.mark.parametrize("name, shape", sorted(PLUGIN_SHAPES.items()))
def test_every_plugin_mesh_device_name_has_the_plugin_shape(name, shape):
    m = meshmod.resolve(name)
    assert m.name == name
    assert m.shape == shape
    assert (m.rows, m.cols) == shape and m.num_devices == shape[0] * shape[1]
    assert m.axis_size("rows") == shape[0] and m.axis_size("cols") == shape[1]
    assert m.describe() == f"{name} {shape[0]}x{shape[1]}"


@pytest.mark.parametrize("name, shape", sorted(PLUGIN_SHAPES.items()))
def test_chip_facts(name, shape):
    chip = meshmod.resolve(name).chip
    if name in WORMHOLE_NAMES:
        assert chip.arch == "wormhole_b0"
        assert chip.dram_bytes == WH_DRAM and chip.l1_bytes == WH_L1
        assert chip.dram_banks == 12 and chip.dram_alignment == 32
    elif name == "P100":  # "P150 (P100 if 7 DRAM channels)"
        assert chip.arch == "blackhole" and chip.dram_banks == 7
        assert chip.dram_bytes == 7 * 4_277_141_376
    else:
        assert chip.arch == "blackhole"
        assert chip.dram_bytes == BH_DRAM and chip.l1_bytes == BH_L1
        assert chip.dram_banks == 8 and chip.dram_alignment == 64


def test_wormhole_dram_is_about_12_gib_and_blackhole_about_32():
    assert 11.9 < WH_DRAM / 2**30 < 12.0
    assert 31.8 < BH_DRAM / 2**30 < 32.0


@pytest.mark.parametrize("name, facts", sorted(GALAXIES.items()))
def test_galaxies(name, facts):
    shape, hosts, arch = facts
    m = meshmod.resolve(name)
    assert (m.shape, m.hosts, m.chip.arch) == (shape, hosts, arch)
    assert m.topology == "torus"


def test_chip_count_to_name_matches_the_plugin():
    # "Chip count -> name: WH 1 N150, 2 N300, 4 N150x4, 8 T3K, 32 TG; BH 1 P150, 2 P300, 4 P150x4, 8 P150x8"
    for n, name in {1: "N150", 2: "N300", 4: "N150x4", 8: "T3K", 32: "TG"}.items():
        assert meshmod.resolve(name).num_devices == n and meshmod.resolve(name).chip.arch == "wormhole_b0"
    for n, name in {1: "P150", 2: "P300", 4: "P150x4", 8: "P150x8"}.items():
        assert meshmod.resolve(name).num_devices == n and meshmod.resolve(name).chip.arch == "blackhole"


def test_presets_hold_exactly_the_plugin_names_and_galaxies():
    assert set(meshmod.PRESETS) == set(PLUGIN_SHAPES) | set(GALAXIES)


@pytest.mark.parametrize("text, shape, arch, name", [
    ("(4,8)", (4, 8), "wormhole_b0", "(4,8)"),
    (" ( 2 , 4 ) ", (2, 4), "wormhole_b0", "(2,4)"),
    ("(1,1)", (1, 1), "wormhole_b0", "(1,1)"),
    ("(2,2)@blackhole", (2, 2), "blackhole", "(2,2)@blackhole"),
    ("(1,8)@Blackhole", (1, 8), "blackhole", "(1,8)@blackhole"),
])
def test_tuple_meshes(text, shape, arch, name):
    m = meshmod.resolve(text)
    assert (m.shape, m.chip.arch, m.name) == (shape, arch, name)
    assert m.chip.dram_bytes == (BH_DRAM if arch == "blackhole" else WH_DRAM)


@pytest.mark.parametrize("text", ["(0,4)", "(4,0)", "(16,17)"])
def test_tuple_meshes_out_of_range(text):
    with pytest.raises(InvalidInput) as ei:
        meshmod.resolve(text)
    assert "rows and cols must be >= 1 with at most 256 chips" in ei.value.message
    assert meshmod.try_resolve(text) is None


@pytest.mark.parametrize("text", ["T3000", "t3k", "n150", "(1,8)@grayskull", "(1;8)", "", "TG ", 8, None])
def test_unknown_mesh_lists_every_valid_name(text):
    with pytest.raises(InvalidInput) as ei:
        meshmod.resolve(text)
    msg = ei.value.message
    assert repr(text) in msg
    listed = msg.split("valid: ", 1)[1]
    for name in list(PLUGIN_SHAPES) + list(GALAXIES):
        assert re.search(rf"(^|, ){re.escape(name)}(,|$)", listed), name
    assert '"(R,C)"' in listed
    assert meshmod.try_resolve(text) is None


@pytest.mark.parametrize("a,b,same", [
    ("(1,8)", "T3K", True), ("T3K", "(1,8)", True), ("(8,4)", "TG", True), ("(1,2)", "N300", True),
    ("(1,1)", "N150", True), ("(1,8)", "P150x8", False), ("(1,8)@blackhole", "P150x8", True),
    ("(2,4)", "T3K", False), ("N150", "P150", False), ("T3K", "T3K", True), ("(1,x)", "T3K", False),
])
def test_same_mesh_matches_tuples_to_presets_by_shape_and_chip(a, b, same):
    """Tenstorrent's MESH_DEVICE may be a shape: "(1,8)" is the T3K preset, not Blackhole's 1x8."""
    assert meshmod.same_mesh(a, b) is same
