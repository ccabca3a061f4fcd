"""DeepSpeed's ZeRO-3 coordinator replayed (optimizer/deepspeed/zero3_gather.py): hand-worked orders, from its rules.

The real-DeepSpeed check (the replay equals the parameters DeepSpeed holds gathered or in flight when forward
ends, on 2 CPU ranks) is tests/real/deepspeed/test_zero3_gather_real.py.
"""

from __future__ import annotations

from optimizer.deepspeed.zero3_gather import GatherSettings, autograd_copies, gathered, replay

# Three leaf modules a, b, c in a container r: r(a(), b(), c()), then backward c, b, a (r last).
# Parameters: a owns 0 (100 elements), b owns 1 (100), c owns 2 (100); r owns none.
MODULE_PARAMS = [[], [0], [1], [2]]  # r, a, b, c
NUMEL = [100, 100, 100]
EVENTS = [("forward_pre", 0), ("forward_pre", 1), ("forward_post", 1), ("forward_pre", 2), ("forward_post", 2),
          ("forward_pre", 3), ("forward_post", 3), ("forward_post", 0),
          ("backward_pre", 0), ("backward_pre", 3), ("backward_post", 3), ("backward_pre", 2), ("backward_post", 2),
          ("backward_pre", 1), ("backward_post", 1), ("backward_post", 0)]


def _settings(prefetch: int, reuse: int = 0, max_live: int = 10**9) -> GatherSettings:
    return GatherSettings(prefetch_bucket=prefetch, max_live=max_live, max_reuse_distance=reuse,
                          persistence_threshold=10)


def test_without_prefetch_each_module_is_released_after_it_runs():
    # prefetch 0: nothing is popped past the module's own entries, so every mark is the use at hand
    after = replay(events=EVENTS, module_params=MODULE_PARAMS, param_numel=NUMEL, settings=_settings(0))
    assert after == [0, 100, 0, 100, 0, 100, 0, 0, 0, 100, 0, 100, 0, 100, 0, 0]


def test_the_prefetch_front_marks_parameters_for_backward_and_keeps_them_across_the_turn():
    # Trace (pre events): steps 0 r, 1 a, 2 b, 3 c, 4 r, 5 c, 6 b, 7 a; queue: (0,1) (1,2) (2,3) (2,5) (1,6) (0,7).
    # Step 0 (r): no own params; prefetch pops (0,1): a gathered, 100.
    # Step 1 (a): pops own entry? a's mark is 1 = step, so nothing to pop; prefetch pops (1,2): b gathered, 200.
    #   a released at step 2 (mark 1 <= 2): 100.
    # Step 2 (b): prefetch pops (2,3): c gathered, 200; b released: 100.
    # Step 3 (c): prefetch pops (2,5) (c is available: mark 5, nothing gathered), (1,6): b gathered, 200, stop.
    #   c released at step 4? its mark 5 > 4: kept. 200 when forward ends.
    # Step 4 (r, backward): prefetch pops (0,7): a gathered, 300 — the peak; queue empty.
    # Step 5 (c): c released at step 6 (mark 5): 200. Step 6 (b): released at 7 (mark 6): 100. Step 7 (a): 0.
    after = replay(events=EVENTS, module_params=MODULE_PARAMS, param_numel=NUMEL, settings=_settings(50))
    assert after == [100, 200, 100, 200, 100, 200, 200, 200, 300, 300, 200, 200, 100, 100, 0, 0]
    assert gathered(events=EVENTS, module_params=MODULE_PARAMS, param_numel=NUMEL, settings=_settings(50)) == \
        (300, 200)


def test_max_live_parameters_stops_the_prefetch():
    # max_live 100: a is prefetched at step 0 (100 live), and from then on the budget min(100 - live, 50) is 0
    # while anything is gathered: each of b and c is fetched at its own use, marked for that use only (its own
    # entry popped), and released after it — nothing is held across the turn (200 were with the bucket alone)
    after = replay(events=EVENTS, module_params=MODULE_PARAMS, param_numel=NUMEL,
                   settings=_settings(50, max_live=100))
    assert after[:8] == [100, 100, 0, 100, 0, 100, 0, 0]


def test_persistent_parameters_are_never_counted():
    numel = [100, 5, 100]  # b's tensor is under the persistence threshold (10)
    after = replay(events=EVENTS, module_params=MODULE_PARAMS, param_numel=numel, settings=_settings(0))
    assert after[3] == 0 and max(after) == 100


# A checkpointed container r(a, b, c) recomputed in backward: the recomputation runs after the backward of r and of
# c began (c's backward needs the recomputed activations). a owns 0, b owns 1, c owns 2 (100 elements each).
RECOMPUTE_EVENTS = [("forward_pre", 0), ("forward_pre", 1), ("forward_post", 1), ("forward_pre", 2),
                    ("forward_post", 2), ("forward_pre", 3), ("forward_post", 3), ("forward_post", 0),
                    ("backward_pre", 0), ("backward_pre", 3),
                    ("forward_pre", 1), ("forward_post", 1), ("forward_pre", 2), ("forward_post", 2),
                    ("forward_pre", 3), ("forward_post", 3),
                    ("backward_post", 3), ("backward_pre", 2), ("backward_post", 2), ("backward_pre", 1),
                    ("backward_post", 1), ("backward_post", 0)]


def test_a_recomputation_holds_its_frozen_parameters_until_the_newest_backward_module_ends():
    # DeepSpeed 0.19.8 (partitioned_param_coordinator.py:37-40, 389-393, 501-504, 517-525): a frozen parameter
    # fetched in a forward inside backward is attributed to the module whose backward began last (c here) and kept
    # until c's backward ends; a trainable one is released after its module runs, as in forward.
    # Prefetch 0. Index 9: c gathered for its backward (100). 10: a recomputed, frozen, held by c (200); 11 kept;
    # 12: b (300); 13: b trains, released (200); 14-15: c, held by itself (200); 16: c's backward ends, a and c go.
    after = replay(events=RECOMPUTE_EVENTS, module_params=MODULE_PARAMS, param_numel=NUMEL, settings=_settings(0),
                   frozen={0, 2})
    assert after[:10] == [0, 100, 0, 100, 0, 100, 0, 0, 0, 100]
    assert after[10:17] == [200, 200, 300, 200, 200, 200, 0]
    assert after[17:] == [100, 0, 100, 0, 0]


def test_without_frozen_parameters_a_recomputation_releases_as_forward_does():
    after = replay(events=RECOMPUTE_EVENTS, module_params=MODULE_PARAMS, param_numel=NUMEL, settings=_settings(0))
    assert after[10:17] == [200, 100, 200, 100, 100, 0, 0]


def test_weights_count_the_gathered_parameters_in_their_own_bytes():
    # a's tensor in fp32 (4 bytes), b's and c's in bf16 (2): the same moments, weighed in bytes
    after = replay(events=EVENTS, module_params=MODULE_PARAMS, param_numel=NUMEL, settings=_settings(50),
                   weights=[400, 200, 200])
    assert after == [400, 600, 200, 400, 200, 400, 400, 400, 800, 800, 600, 600, 400, 400, 0, 0]


# r(a(), b()): a owns 0, b owns 1.
PAIR_EVENTS = [("forward_pre", 0), ("forward_pre", 1), ("forward_post", 1), ("forward_pre", 2), ("forward_post", 2),
               ("forward_post", 0)]
PAIR_PARAMS = [[], [0], [1]]


def test_a_coalesced_prefetch_bucket_is_held_twice_from_its_first_wait_until_its_last_member_is_fetched():
    # Prefetch 150: at r, a (100) and b (100) are popped into one all-gather (two parameters: coalesced, a flat
    # buffer). At a's fetch the bucket is waited (each parameter gets its copy) and a leaves the registry; b stays
    # registered, so the flat buffer (200) is kept until b's own fetch.
    kwargs = {"events": PAIR_EVENTS, "module_params": PAIR_PARAMS, "param_numel": [100, 100],
              "settings": _settings(150)}
    assert replay(**kwargs) == [200, 200, 100, 100, 0, 0]
    assert replay(**kwargs, buffers=True) == [200, 400, 300, 100, 0, 0]


def test_in_the_first_prefetching_step_a_persistent_parameter_joins_a_bucket():
    # a owns a persistent tensor (5 elements, threshold 10). Later steps find it gathered: at r the prefetch pops it
    # without fetching and b's weight alone (one parameter: no flat buffer). In the first step it arrives partitioned,
    # so r's prefetch fetches it with b's weight — a bucket of two, waited at a's fetch and kept until b's (105).
    kwargs = {"events": PAIR_EVENTS, "module_params": PAIR_PARAMS, "param_numel": [5, 100],
              "settings": _settings(50), "buffers": True}
    assert replay(**kwargs) == [100, 100, 100, 100, 0, 0]
    assert replay(**kwargs, first_step=True) == [100, 205, 205, 100, 0, 0]


def _copies(settings: GatherSettings, held: list[int], numel: list[int] = NUMEL, previous: bool = False) -> list[int]:
    return autograd_copies(events=EVENTS, module_params=MODULE_PARAMS, param_numel=numel, settings=settings,
                           held=held, previous_graph=previous)


def test_a_weight_autograd_keeps_outlives_its_release_until_the_step_ends():
    # No prefetch: each module's parameter is gathered for its use and released after it (the first test). a and c
    # are 4-bit weights bitsandbytes' matmul kept for backward: each release after forward leaves its forward copy
    # (a from event 2, c from event 6), and backward's gathers are second copies, which the coordinator counts
    copies = _copies(_settings(0), [0, 2])
    assert copies == [0, 0, 100, 100, 100, 100, 200, 200, 200, 200, 200, 200, 200, 200, 200, 200]
    # with the coordinator's own: c in backward (event 9) is its forward copy + the new one + a's forward copy
    plain = replay(events=EVENTS, module_params=MODULE_PARAMS, param_numel=NUMEL, settings=_settings(0))
    assert plain[9] + copies[9] == 300


def test_a_loop_that_keeps_the_last_loss_holds_the_previous_micro_steps_copies_through_forward():
    # previous_graph: the previous micro-step's forward copies of a and c (200) until the model's forward returns
    # (r's forward_post, event 7: ``loss = engine(batch)`` then drops the old graph)
    difference = [x - y for x, y in zip(_copies(_settings(0), [0, 2], previous=True), _copies(_settings(0), [0, 2]),
                                         strict=True)]
    assert difference == [200] * 7 + [0] * 9


def test_a_weight_kept_gathered_across_the_turn_is_one_copy_and_a_persistent_one_never_counts():
    # prefetch 50 keeps c gathered from its forward use into its backward (the second test): one copy, the
    # coordinator's, until its backward releases it (event 10); from then on the node still holds that storage
    assert _copies(_settings(50), [2]) == [0] * 10 + [100] * 6
    # a persistent tensor (b: 5 elements) is never released, so it is never a copy, not even the previous step's
    assert _copies(_settings(0), [1], numel=[100, 5, 100], previous=True) == [0] * 16
