"""Speculative decoding in the analytic planner (Workload.spec_tokens, acceptance, spec_method):
a step verifies k + 1 tokens of every sequence and gains 1 + a + ... + a^k of them; an MTP
drafter adds a decoder layer and the LM head a drafted token. Checked on DeepSeek-V3 at batch 1
on one H200 node, where a verify step costs little more than a plain one."""

import dataclasses

import pytest

from atoll.errors import ConfigError
from atoll.planner import Workload, plan_layouts
from atoll.planner.points import cost_model
from atoll.topologies import load_topology

BASE = Workload(isl=1024, osl=2048, concurrency=1, dtype="fp8")
LAYOUT = "TP8EP4MOETP2"


def _user_rate(w: Workload) -> float:
    topo = load_topology("dgx-h200", nodes=1)
    return plan_layouts("DeepSeek-V3", topo, w, layouts=[LAYOUT]).predictions[0].tokens_per_s_per_user


def test_tokens_per_step_is_the_chain_of_kept_drafts():
    assert BASE.tokens_per_step == 1
    assert dataclasses.replace(BASE, spec_tokens=3, acceptance=0.5).tokens_per_step == pytest.approx(1.875)
    assert dataclasses.replace(BASE, spec_tokens=3, acceptance=1.0).tokens_per_step == 4


def test_speculation_speeds_a_lone_user_up_by_less_than_its_tokens_per_step():
    plain = _user_rate(BASE)
    mtp = dataclasses.replace(BASE, spec_tokens=3, acceptance=0.7, spec_method="mtp")
    ngram = dataclasses.replace(mtp, spec_method="ngram")
    fast, free = _user_rate(mtp), _user_rate(ngram)
    # a verify step reads more experts and the MTP layer drafts: the gain is under 2.533x
    assert 1.5 * plain < fast < free < mtp.tokens_per_step * plain
    none = dataclasses.replace(mtp, acceptance=0.0)  # every draft rejected: only the cost remains
    assert _user_rate(none) < plain


def test_a_verify_step_reads_the_drafted_tokens_experts_and_the_mtp_layer():
    topo = load_topology("dgx-h200", nodes=1)
    spec = dataclasses.replace(BASE, spec_tokens=3, acceptance=0.7, spec_method="mtp").resolved(
        cost_model("DeepSeek-V3", topo, LAYOUT, BASE)[0].c)
    plain = cost_model("DeepSeek-V3", topo, LAYOUT, BASE)[0].decode(1)[1]
    verify = cost_model("DeepSeek-V3", topo, LAYOUT, spec)[0].decode(1)[1]
    assert verify["HBM reads of expert weights"] > 2 * plain["HBM reads of expert weights"]
    assert verify["speculative drafting (MTP layer)"] > 0 and "speculative drafting (MTP layer)" not in plain


@pytest.mark.parametrize("field,value", [("spec_tokens", -1), ("spec_tokens", 99), ("spec_tokens", 1.5),
                                         ("acceptance", 1.2), ("acceptance", -0.1), ("spec_method", "eagle9")])
def test_bad_speculation_is_one_line(field, value):
    with pytest.raises(ConfigError, match=field):
        Workload(**{field: value})
