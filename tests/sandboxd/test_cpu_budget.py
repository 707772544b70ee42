"""The fork-server CPU budget's /proc arithmetic, on made-up /proc text whose answers are known."""

from __future__ import annotations

from pathlib import Path

from benchmarks.cpu_budget import (
    BARE,
    LOADGEN,
    OTHER,
    SERVER,
    TREE,
    Proc,
    Snapshot,
    account,
    descendants,
    own_ticks,
    parse_cpu_lines,
    parse_pid_stat,
    read_children,
)


def _stat(pid: int, comm: str, ppid: int, ut: int, st: int, cut: int, cst: int, start: int) -> str:
    """A /proc/<pid>/stat line with the fields this reads set, the rest zero."""
    fields = ["S", str(ppid)] + ["0"] * 9 + [str(ut), str(st), str(cut), str(cst)]
    fields += ["20", "0", "1", "0", str(start)] + ["0"] * 30
    return f"{pid} ({comm}) " + " ".join(fields)


def test_pid_stat_with_a_hostile_command_name() -> None:
    p = parse_pid_stat(_stat(42, "a) (b ) c", 7, 10, 5, 100, 50, 12345))
    assert (p.pid, p.comm, p.ppid, p.starttime) == (42, "a) (b ) c", 7, 12345)
    assert (p.own, p.reaped) == (15, 150)
    assert (
        not p.kernel_thread
        and parse_pid_stat(_stat(9, "kworker/0:1-ev", 2, 0, 0, 0, 0, 1)).kernel_thread
    )


def test_cpu_lines_count_irq_and_steal_as_busy_but_not_guest_twice() -> None:
    text = (
        "cpu  100 10 50 1000 20 5 7 3 40 0\n"
        "cpu0 60 5 25 500 10 3 4 2 40 0\n"
        "cpu1 40 5 25 500 10 2 3 1\n"  # an older kernel: no guest columns
        "intr 1 2 3\nctxt 9\n"
    )
    cpus = parse_cpu_lines(text)
    assert cpus["cpu"] == (100 + 10 + 50 + 5 + 7 + 3, 175 + 1000 + 20)
    assert cpus["cpu1"] == (76, 76 + 510)
    assert set(cpus) == {"cpu", "cpu0", "cpu1"}


def _snap(busy: int, *procs: Proc) -> Snapshot:
    return Snapshot({"cpu": (busy, busy * 2), "cpu0": (busy, busy * 2)}, {p.pid: p for p in procs})


def test_a_window_charges_each_group_what_it_spent_in_it() -> None:
    bench, server, bwrap, zygote = 100, 200, 300, 301
    before = _snap(
        10_000,
        Proc(1, "init", 0, 1, 500, 900),
        Proc(bench, "python", 1, 50, 40, 0),
        Proc(server, "python", bench, 60, 300, 0),
        Proc(bwrap, "bwrap", server, 70, 1, 0),
        Proc(zygote, "python3", bwrap, 71, 20, 1000),
        Proc(400, "runner", zygote, 80, 7, 0),  # a runner that runs and is reaped in the window
        Proc(2, "kthreadd", 0, 0, 1, 0),
        Proc(10, "kworker/0:1-events", 2, 5, 30, 0),
        Proc(11, "kworker/1:2-netns", 2, 6, 99, 0),  # dies in the window: missed
        Proc(500, "other-user-job", 1, 90, 1000, 0),
    )
    after = _snap(
        10_400,
        Proc(1, "init", 0, 1, 510, 900),
        Proc(bench, "python", 1, 50, 55, 0),
        Proc(server, "python", bench, 60, 380, 0),
        Proc(bwrap, "bwrap", server, 70, 1, 0),
        Proc(zygote, "python3", bwrap, 71, 60, 1000 + 9 + 150),  # 400 reaped (9) + others (150)
        Proc(401, "runner", zygote, 5000, 3, 0),  # born in the window
        Proc(2, "kthreadd", 0, 0, 1, 0),
        Proc(10, "kworker/0:1-mm_percpu_wq", 2, 5, 42, 0),  # renamed: same thread
        Proc(12, "kworker/u4:0", 2, 5001, 4, 0),  # born in the window: all of it
        Proc(11, "ksoftirqd/1", 2, 5002, 5, 0),  # pid 11 again, a new thread: all of it
        Proc(500, "other-user-job", 1, 90, 1030, 0),
    )
    acc = account(before, after, bench, server)
    g = acc["groups_ticks"]
    assert g[LOADGEN] == 15 and g[BARE] == 0 and g[SERVER] == 80
    assert g[TREE] == (60 + 1159 + 3) - (20 + 1000 + 7)  # 195: the reaped runner's 2 more ticks in
    assert g["kernel: kworker*"] == 12 + 4 and g["kernel: ksoftirqd*"] == 5
    assert g[OTHER] == 10 + 30
    assert acc["other_users_top_ticks"] == {"other-user-job": 30, "init": 10}
    assert acc["kernel_threads_died_unseen"] == 1
    assert acc["busy_ticks"] == 400 and acc["elapsed_ticks"] == 800
    assert acc["unattributed_ticks"] == 400 - sum(g.values())
    assert acc["per_cpu_busy_share"] == {"cpu0": 0.5}


def test_without_a_server_the_bench_process_children_are_the_bare_spawns() -> None:
    before = _snap(0, Proc(100, "python", 1, 5, 10, 20))
    after = _snap(50, Proc(100, "python", 1, 5, 14, 60))
    g = account(before, after, 100)["groups_ticks"]
    assert g == {LOADGEN: 4, BARE: 40}


def test_descendants_walk_the_whole_tree_only() -> None:
    procs = {p.pid: p for p in (Proc(1, "a", 0, 0, 0, 0), Proc(2, "b", 1, 0, 0, 0),
                                Proc(3, "c", 2, 0, 0, 0), Proc(4, "d", 9, 0, 0, 0))}  # fmt: skip
    assert descendants(procs, 1) == {2: 1, 3: 2} and descendants(procs, 3) == {}


def test_a_replaced_zygote_is_charged_up_to_its_last_sample() -> None:
    first = {
        (301, 71): Proc(301, "python3", 300, 71, 20, 1000),
        (300, 70): Proc(300, "bwrap", 200, 70, 1, 0),
    }
    last = {
        (301, 71): Proc(301, "python3", 300, 71, 55, 2000),  # replaced: its last sample
        (300, 70): Proc(300, "bwrap", 200, 70, 1, 0),
        (310, 900): Proc(310, "bwrap", 200, 900, 2, 0),  # its successor, born in the window
        (311, 901): Proc(311, "python3", 310, 901, 30, 400),
    }
    assert own_ticks(first, last) == 35 + 0 + 2 + 30


def test_children_of_every_thread(tmp_path: Path) -> None:
    for tid, kids in ((7, "8 9 "), (70, "12"), (71, "")):
        task = tmp_path / "7" / "task" / str(tid)
        task.mkdir(parents=True)
        (task / "children").write_text(kids)
    assert sorted(read_children(7, tmp_path)) == [8, 9, 12]
    assert read_children(5, tmp_path) == []
