"""Layout parsing and validation, and the rank grid arithmetic, without processes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atoll.errors import LayoutError
from atoll.models.config import ModelConfig
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import coords, group_ranks


def dense(heads=32, kv=8, layers=32, inter=14336, **kw):
    return ModelConfig.from_dict(dict(model_type="llama", vocab_size=1000, hidden_size=heads * 64,
                                      intermediate_size=inter, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, **kw))


@pytest.mark.parametrize("text,fields", [
    ("TP8PP2", dict(tp=8, pp=2, dp=1, ep=1, moe_tp=8)),
    ("TP2PP2", dict(tp=2, pp=2)),
    ("DP4EP4", dict(tp=1, dp=4, ep=4, moe_tp=1)),
    ("TP4EP4", dict(tp=4, ep=4, moe_tp=1)),
    ("EP16", dict(tp=16, ep=16, moe_tp=1)),
    ("tp2pp3", dict(tp=2, pp=3)),
])
def test_parse(text, fields):
    layout = Layout.parse(text)
    for k, v in fields.items():
        assert getattr(layout, k) == v
    assert Layout.parse(str(layout)) == layout


@pytest.mark.parametrize("text", ["", "TP", "TP0", "TP2XY3", "PP2TP2TP2", "TP3EP2"])
def test_parse_rejects(text):
    with pytest.raises(LayoutError):
        Layout.parse(text)


@st.composite
def layouts(draw):
    tp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    dp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3, 4]))
    stage = tp * dp
    ep = draw(st.sampled_from([d for d in range(1, stage + 1) if stage % d == 0]))
    cp = draw(st.sampled_from([1, 2, 4])) if dp == ep == 1 else 1  # cp combines with tp and pp only
    return Layout(tp=tp, dp=dp, pp=pp, ep=ep, cp=cp)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_grid_partitions_every_kind(layout):
    groups = group_ranks(layout)
    world = layout.world_size
    sizes = {"tp": layout.tp, "dp": layout.dp, "cp": layout.cp, "pp": layout.pp, "ep": layout.ep,
             "moe_tp": layout.moe_tp, "stage": layout.stage_size, "world": world}
    for kind, gs in groups.items():
        flat = sorted(r for g in gs for r in g)
        assert flat == list(range(world)), kind  # every rank in exactly one group of each kind
        assert all(len(g) == sizes[kind] for g in gs), kind
    assert Layout.parse(str(layout)) == layout
    for rank in range(world):
        c = coords(layout, rank)
        tp_group = next(g for g in groups["tp"] if rank in g)
        assert tp_group.index(rank) == c.tp
        assert next(g for g in groups["pp"] if rank in g).index(rank) == c.pp
        assert next(g for g in groups["dp"] if rank in g).index(rank) == c.dp
        assert next(g for g in groups["cp"] if rank in g).index(rank) == c.cp
        assert next(g for g in groups["ep"] if rank in g).index(rank) == c.ep
        assert next(g for g in groups["moe_tp"] if rank in g).index(rank) == c.moe_tp
        # TP innermost: a TP group is consecutive ranks; a stage is a consecutive block
        assert tp_group == list(range(tp_group[0], tp_group[0] + layout.tp))
        assert rank // layout.stage_size == c.pp


def test_validate_names_the_numbers():
    with pytest.raises(LayoutError, match=r"tp=3 does not divide num_attention_heads=32.*1, 2, 4, 8"):
        Layout(tp=3).validate(dense())
    with pytest.raises(LayoutError, match="pp=40 exceeds num_hidden_layers=32"):
        Layout(pp=40).validate(dense())
    with pytest.raises(LayoutError, match="needs 4 ranks, got 3"):
        Layout(tp=2, pp=2).validate(dense(), world_size=3)
    with pytest.raises(LayoutError, match="dense model"):
        Layout.parse("EP2").validate(dense())


def test_kv_heads_replicated_when_fewer_than_tp():
    Layout(tp=16).validate(dense(heads=32, kv=8))  # 8 KV heads on TP16: each held by 2 ranks
    Layout(tp=4).validate(dense(heads=4, kv=2, inter=128))
    with pytest.raises(LayoutError, match="tp=6"):
        Layout(tp=6).validate(dense(heads=24, kv=8))  # 6 neither divides nor is divided by 8


def test_shrunk_drops_lost_ranks_from_dp_and_ep():
    assert str(Layout.parse("DP4EP4").shrunk()) == "DP3EP3" and Layout.parse("DP4EP4").shrunk().world_size == 3
    assert Layout.parse("DP3EP3").shrunk(2) == Layout()  # one rank left: TP1
    for text in ("TP2DP2EP4", "EP4", "DP2EP2PP2"):
        with pytest.raises(LayoutError, match="only DPnEPn"):
            Layout.parse(text).shrunk()
    with pytest.raises(LayoutError, match="cannot lose 2 of its 2 ranks"):
        Layout.parse("DP2EP2").shrunk(2)
