"""Slurm's compressed host lists expand as `scontrol show hostnames` expands them, and the
resolver's first host (the store's) is the first of that list."""

from __future__ import annotations

import pytest

from stratagem.cluster.resolvers import SlurmClusterResolver, expand_hostlist


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        # two bracket groups: their product, the leftmost varying slowest (scontrol's order)
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("r[1,3]n[1-2]x", ["r1n1x", "r1n2x", "r3n1x", "r3n2x"]),
        ("a[1-2]b[3]c[08-10]", ["a1b3c08", "a1b3c09", "a1b3c10", "a2b3c08", "a2b3c09", "a2b3c10"]),
        # a bracket group in a middle name, between plain ones
        ("login,rack[1-2]-node[1],gpu-a", ["login", "rack1-node1", "rack2-node1", "gpu-a"]),
        ("node[8-10]", ["node8", "node9", "node10"]),  # no padding asked, none added
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("single", ["single"]),
    ],
)
def test_host_lists_expand_as_scontrol_does(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("node[01-03", r"'node\[01-03'.*not closed"),
        ("node]1[", "do not pair up"),
        ("node[[1]]", "do not pair up"),
        ("node[]", "empty brackets"),
        ("node[a-b]", "'a-b' in 'node\\[a-b\\]' is not a number or a range"),
        ("node[5-2]", "runs backwards"),
    ],
)
def test_a_bad_host_list_is_an_error_naming_it(text, says):
    with pytest.raises(ValueError, match=says):
        expand_hostlist(text)


def test_the_resolver_puts_the_store_on_the_first_host_of_two_groups():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "rack[1-2]-node[01-02]",
           "SLURM_TASKS_PER_NODE": "1(x4)", "SLURM_NODEID": "3", "SLURM_JOB_ID": "42"}
    spec = SlurmClusterResolver(env).cluster_spec()
    assert spec.workers == ("rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02")
    assert spec.master_addr == "rack1-node01"
    assert spec.task_index == 3  # SLURM_NODEID 3: rack2-node02, which the old expander never listed
    assert (spec.rank, spec.world_size) == (3, 4)
