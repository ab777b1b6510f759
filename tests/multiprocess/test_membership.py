"""Group membership as a state machine, without processes or sockets."""

from elastic_runtime.cluster.controller.membership import JoinReport, Membership


def test_survivors_keep_their_process_ids_and_recruits_take_the_free_ones() -> None:
    group = Membership(size=4)
    group.new_generation(group.seat([], [10, 11, 12, 13]))
    assert group.members == [10, 11, 12, 13] and group.generation == 1
    assert group.seat([10, 12, 13], [20]) == [10, 20, 12, 13]
    assert group.seat([11], [20, 21]) == [20, 11, 21]  # smaller than full: the rest go on at the end
    assert group.seat([10, 11, 12, 13], [20]) == [10, 11, 12, 13, 20]


def test_the_group_commits_a_step_once_every_member_has() -> None:
    group = Membership(size=3)
    assert group.progress([3, 2, 5]) == [1, 2]
    assert group.progress([3, 3, 5]) == [3]
    assert group.progress([3, 3, 5]) == []
    assert group.step == 3 and group.high_water == 3


def test_the_newest_step_any_member_holds_is_restored_and_the_others_take_it_from_it() -> None:
    group = Membership(size=3)
    group.progress([7, 7, 7])
    plan = group.plan_restore([JoinReport(6, "ram"), JoinReport(7, "ram"), JoinReport(7, "file")])
    assert (plan.step, plan.source, plan.restored_from, plan.lost_steps) == (7, 1, "ram+peer", 0)
    plan = group.plan_restore([JoinReport(5, "file"), JoinReport(5, "file")])
    assert (plan.step, plan.source, plan.restored_from, plan.lost_steps) == (5, 0, "file", 2)
    assert group.restore(5) == [] and group.step == 5 and group.high_water == 7
    assert group.restore(8) == [6, 7, 8]  # steps the restored member committed before the old group said so


def test_a_group_with_nothing_to_restore_starts_from_the_initial_state() -> None:
    plan = Membership(size=2).plan_restore([JoinReport(0, "none"), JoinReport(0, "none")])
    assert (plan.step, plan.source, plan.restored_from) == (0, -1, "init")


def test_a_slice_short_of_a_process_is_left_out_whole() -> None:
    group = Membership(size=4, slice_size=2)
    group.new_generation(group.seat([], [10, 11, 12, 13]))
    assert group.seat([10, 12, 13], [20]) == [10, 20, 12, 13]  # a replacement completes slice 0
    assert group.seat([10, 12, 13], []) == [12, 13]  # none: slice 0 waits; 10 is not seated
    assert group.seat([12, 13], [10, 20]) == [10, 20, 12, 13]  # and grows back whole


def test_a_slice_restores_the_newest_step_all_its_processes_hold() -> None:
    group = Membership(size=4, slice_size=2)
    group.progress([9, 9, 9, 9])
    # Slice 0 lost a process: its replacement read that process's replica file, one step behind.
    reports = [JoinReport(9, "ram", (8, 9)), JoinReport(8, "shm", (7, 8)), JoinReport(9, "ram"), JoinReport(9, "ram")]
    plan = group.plan_restore(reports)
    assert (plan.step, plan.source, plan.restored_from, plan.lost_steps) == (9, 1, "ram+peer", 0)
    # One slice only: it rolls back to the step its processes all hold, its survivors from their own files.
    one = Membership(size=2, slice_size=2)
    one.progress([9, 9])
    plan = one.plan_restore([JoinReport(9, "ram", (8, 9)), JoinReport(8, "shm", (7, 8))])
    assert (plan.step, plan.source, plan.restored_from, plan.lost_steps) == (8, 0, "file+shm", 1)


# One slice of 4 that committed step 25, durable step 20 in GCS: a survivor holds 25 in RAM and keeps its
# neighbour's shards of 25; a replacement can read only durable step 20.
SURVIVOR = JoinReport(25, "ram", (20, 24, 25), durable_only=(20,), neighbour_step=25)
REPLACEMENT = JoinReport(20, "durable", (20,), durable_only=(20,))


def slice_at_25() -> Membership:
    group = Membership(size=4, slice_size=4)
    group.progress([25, 25, 25, 25])
    return group


def test_a_lost_process_shards_come_from_the_next_process_neighbour_replica() -> None:
    group, survivor, replacement = slice_at_25(), SURVIVOR, REPLACEMENT
    # Process 2's replacement can read only durable step 20; process 3 keeps process 2's shards of step 25.
    plan = group.plan_restore([survivor, survivor, replacement, survivor])
    assert (plan.step, plan.source, plan.from_neighbour, plan.lost_steps) == (25, 0, (2,), 0)
    assert plan.restored_from == "neighbour+ram"
    # Process 0's shards are kept by process 1 (the slice wraps around).
    plan = group.plan_restore([replacement, survivor, survivor, survivor])
    assert (plan.step, plan.from_neighbour) == (25, (0,))
    # At a durable step the neighbour's RAM is preferred to the durable tier, but not to the process's own file.
    at_20 = JoinReport(20, "ram", (20,), neighbour_step=20)
    plan = group.plan_restore([at_20, at_20, replacement, at_20])
    assert (plan.step, plan.from_neighbour) == (20, (2,))
    own_file = JoinReport(20, "shm", (19, 20))
    plan = group.plan_restore([at_20, at_20, own_file, at_20])
    assert (plan.step, plan.from_neighbour, plan.restored_from) == (20, (), "ram+shm")


def test_two_neighbours_lost_together_roll_back_to_a_step_the_durable_tier_holds() -> None:
    # Processes 2 and 3 lost: process 3 kept process 2's shards, and its replacement holds nothing of them.
    plan = slice_at_25().plan_restore([SURVIVOR, SURVIVOR, REPLACEMENT, REPLACEMENT])
    assert (plan.step, plan.from_neighbour, plan.lost_steps) == (20, (), 5)


def test_no_slice_holding_one_step_whole_goes_back_to_the_initial_state_and_says_why() -> None:
    # Never end a run that can go on (issue 62, hole 1): init is deterministic, so the steps are lost, not the job.
    group = Membership(size=2, slice_size=2)
    group.progress([9, 9])
    plan = group.plan_restore([JoinReport(9, "ram"), JoinReport(0, "none")])
    assert (plan.step, plan.source, plan.restored_from, plan.lost_steps) == (0, -1, "init", 9)
    assert "no slice holds one step whole" in plan.fallback
    assert "the shards of process(es) [1] at step 9 are nowhere" in plan.fallback


def test_a_group_that_committed_steps_but_holds_none_starts_again_and_says_why() -> None:
    group = Membership(size=2)
    group.progress([9, 9])
    plan = group.plan_restore([JoinReport(0, "none"), JoinReport(0, "none")])
    assert (plan.step, plan.source, plan.lost_steps) == (0, -1, 9)
    assert "committed step 9, but no member holds any step" in plan.fallback


def test_a_group_that_committed_nothing_starts_from_init_with_nothing_to_explain() -> None:
    plan = Membership(size=2).plan_restore([JoinReport(0, "none"), JoinReport(0, "none")])
    assert (plan.step, plan.source, plan.lost_steps, plan.fallback) == (0, -1, 0, "")


def test_a_restore_fences_every_earlier_generation_at_the_step_the_group_went_on_from() -> None:
    group = Membership(size=3)
    group.new_generation([0, 1, 2])
    group.restore(0)
    assert group.fences == {}  # the first generation replaces nobody
    group.new_generation([0, 2])  # generation 2: worker 1 cut off after step 6
    group.restore(6)
    assert group.fences == {1: 6}
    group.new_generation([0, 2, 3])
    group.restore(11)
    assert group.fences == {1: 6, 2: 11}
    group.new_generation([4, 5, 6])  # every worker replaced; the files held step 9 at best
    group.restore(9)
    assert group.fences == {1: 6, 2: 9, 3: 9}  # the history past 9 is generation 4's alone
    # A resumed run (a new controller) numbers its generations after the old ones and keeps their fences.
    resumed = Membership(size=3, generation=4, fences=group.fences)
    assert resumed.new_generation([0, 1, 2]) == 5
    resumed.restore(12)
    assert resumed.fences == {1: 6, 2: 9, 3: 9, 4: 12}


def test_a_report_moves_the_group_step_once_the_last_member_at_it_moves_on() -> None:
    group = Membership(3)
    group.new_generation([0, 1, 2])
    group.restore(5)
    assert group.report(0, 7) == [] and group.report(1, 6) == []
    assert group.report(2, 8) == [6]
    assert group.report(1, 9) == [7] and group.step == 7
    assert group.report(0, 6) == []  # older than what it said: changes nothing
    assert group.report(3, 20) == []  # not a member
    assert group.has(2) and not group.has(3)
