"""tests/suite_groups.py: how `make test` splits the suite between its two xdist workers."""

from suite_groups import SESSION_RAY, Entry, groups


def _t(nodeid, fixtures=(), module=(), marked=False):
    return Entry(nodeid, frozenset(fixtures) | frozenset(module), frozenset(module), marked)


def test_the_session_rays_tests_are_one_group_and_module_fixtures_stay_on_one_worker():
    got = groups([
        _t("tests/test_a.py::test_unit", ["tmp_path"]),
        _t("tests/test_a.py::test_run", ["ray_session", "run"], module=["run"]),
        _t("tests/test_a.py::test_reads_the_run", ["tmp_path"], module=["run"]),    # shares `run`
        _t("tests/test_a.py::test_reads_its_cluster", module=["cluster"]),
        _t("tests/test_a.py::test_reads_its_cluster_again", module=["cluster", "other"]),
        _t("tests/test_b.py::test_cli[x]", ["ray_address"]),
        _t("tests/test_b.py::test_own_ray[x]", ["tmp_path"]),
        _t("tests/test_c.py::test_one", marked=True),                                # pytest.mark.session_ray
        _t("tests/faults/test_d.py::T::test_two", ["redis_server"]),
        _t("tests/test_e.py::test_uses_run_of_its_own_file", module=["run"]),        # another file's `run`
    ])
    assert got == {
        "tests/test_a.py::test_unit": "tests/test_a.py",
        "tests/test_a.py::test_run": SESSION_RAY,
        "tests/test_a.py::test_reads_the_run": SESSION_RAY,
        "tests/test_a.py::test_reads_its_cluster": "tests/test_a.py",
        "tests/test_a.py::test_reads_its_cluster_again": "tests/test_a.py",
        "tests/test_b.py::test_cli[x]": SESSION_RAY,
        "tests/test_b.py::test_own_ray[x]": "tests/test_b.py",
        "tests/test_c.py::test_one": SESSION_RAY,
        "tests/faults/test_d.py::T::test_two": "tests/faults/test_d.py",
        "tests/test_e.py::test_uses_run_of_its_own_file": "tests/test_e.py"}


def test_a_chain_of_module_fixtures_is_followed():
    got = groups([_t("t.py::a", ["ray_session"], module=["x"]), _t("t.py::b", module=["x", "y"]),
                  _t("t.py::c", module=["y"]), _t("t.py::d", module=["z"])])
    assert got == {"t.py::a": SESSION_RAY, "t.py::b": SESSION_RAY, "t.py::c": SESSION_RAY, "t.py::d": "t.py"}
