"""Under vLLM's Ray executor the drafter's GPU is a spare bundle of vLLM's placement group on the output rank's
node: the decisions, as pure functions of bundles, nodes and devices (the CPU build cannot run the Ray executor:
vLLM's CPU platform has no `ray_device_key`, and `initialize_ray_cluster` refuses it, docs/layouts.md)."""
from __future__ import annotations

import pytest

from saguaro_vllm.frontend.config import SaguaroConfigError
from saguaro_vllm.frontend.ray_placement import Bundle, drafter_bundle, output_rank, v2_ranks
from saguaro_vllm.worker.rank_placement import check_node, ray_device

A, B = ("node-a", "10.0.0.1"), ("node-b", "10.0.0.2")


def _bundles(*nodes) -> list[Bundle]:
    """GPU bundles in `get_bundles_sorted_by_node` order (driver's node first); index = position given."""
    return [Bundle(i, node[0], node[1]) for i, node in enumerate(nodes)]


def test_output_rank_is_tp_rank_0_of_the_last_stage():
    assert output_rank(1, 1) == 0 and output_rank(4, 1) == 0 and output_rank(2, 2) == 2 and output_rank(4, 3) == 8


def test_one_node_group_with_one_bundle_more_leaves_the_last_to_the_drafter():
    bundles = _bundles(A, A, A)  # TP=2 and the drafter's bundle, as vLLM creates it with world_size + 1
    ranks = v2_ranks(bundles, 2)
    assert [b.index for b in ranks] == [0, 1]
    assert drafter_bundle(bundles, ranks, output_rank(2, 1)) == Bundle(2, *A)


def test_user_bundle_indices_decide_the_ranks_and_what_is_spare():
    bundles = _bundles(A, A, A, A)
    ranks = v2_ranks(bundles, 3, user_indices=[3, 1, 2])  # VLLM_RAY_BUNDLE_INDICES=3,1,2
    assert [b.index for b in ranks] == [3, 1, 2]
    assert drafter_bundle(bundles, ranks, 0).index == 0


def test_pipeline_across_nodes_takes_the_spare_on_the_last_stages_node():
    # PP=2 x TP=2: ranks 0,1 on node A (the driver's), ranks 2,3 on node B; one spare on each node
    bundles = [Bundle(0, *A), Bundle(1, *A), Bundle(4, *A), Bundle(2, *B), Bundle(3, *B), Bundle(5, *B)]
    ranks = [bundles[0], bundles[1], bundles[3], bundles[4]]
    assert drafter_bundle(bundles, ranks, output_rank(2, 2)) == Bundle(5, *B)
    assert drafter_bundle(bundles, ranks, output_rank(2, 2), ray_node="10.0.0.2").index == 5
    assert drafter_bundle(bundles, ranks, output_rank(2, 2), ray_node="node-b").index == 5


def test_no_spare_on_the_output_node_is_refused_naming_the_fix():
    # PP=2 x TP=2 over 3 GPUs of node A and 2 of node B, in vLLM's order (the driver's node A first): the last
    # stage starts on A (rank 2: bundle 4), and the spare bundle is on B
    bundles = [Bundle(0, *A), Bundle(1, *A), Bundle(4, *A), Bundle(2, *B), Bundle(3, *B)]
    ranks = v2_ranks(bundles, 4)
    assert [b.index for b in ranks] == [0, 1, 4, 2]
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.device: 'auto' needs a spare GPU bundle "
                                                 r"in vLLM's Ray placement group on node 10.0.0.1.*spare GPU bundles on "
                                                 r"other nodes: \['10.0.0.2'\].*'cuda:N'.*'cpu'"):
        drafter_bundle(bundles, ranks, output_rank(2, 2))
    with pytest.raises(SaguaroConfigError, match=r"none is spare there\. Free a GPU"):
        drafter_bundle(_bundles(A, A), v2_ranks(_bundles(A, A), 2), 0)  # a group the user made, without a spare


def test_ray_node_other_than_the_output_ranks_is_refused():
    bundles = _bundles(A, A, A)
    with pytest.raises(SaguaroConfigError, match=r"^speculative_config.saguaro.ray_node: '10.0.0.2', but vLLM's Ray "
                                                 r"executor puts the output rank .* on node 10.0.0.1"):
        drafter_bundle(bundles, v2_ranks(bundles, 2), 0, ray_node="10.0.0.2")


def test_the_reserved_gpu_as_the_output_worker_sees_it():
    reserved = {"node_id": "node-a", "node_ip": "10.0.0.1", "physical_gpu": "5", "bundle": 2}
    assert ray_device(reserved, "node-a", None) == "cuda:5"  # vLLM's Ray workers see every GPU of their node
    assert ray_device(reserved, "node-a", "4,5,6,7") == "cuda:1"  # unless the node's raylet was started narrower
    with pytest.raises(ValueError, match=r"reserved for the drafter is on Ray node 10.0.0.1 .* runs on node node-b; "
                                         r"set speculative_config.saguaro.ray_node"):
        ray_device(reserved, "node-b", None)


def test_an_explicit_node_is_checked_where_the_output_worker_runs():
    check_node("10.0.0.1", "node-a", "10.0.0.1")
    check_node("node-a", "node-a", "10.0.0.1")
    with pytest.raises(ValueError, match=r"ray_node is '10.0.0.2', but vLLM's Ray executor put the output rank"):
        check_node("10.0.0.2", "node-a", "10.0.0.1")
