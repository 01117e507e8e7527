"""The collective counter of the mesh checks (mesh_worker.collectives) on the
forms XLA writes an all-reduce in: plain, combined (the all-reduce combiner
merges several into one op with a tuple result, under any instruction
name), asynchronous (an all-reduce-start / all-reduce-done pair), and
asynchronous and combined at once; next to text it must not count.

test_sharding.py reads the counts of real compiled programs (the decode and
verify steps, and two products whose all-reduces XLA combines).
"""

import re

import numpy as np
import pytest

import mesh_worker

PLAIN = """\
  %all-reduce.1 = f32[4,128]{1,0} all-reduce(f32[4,128]{1,0} %fusion.2), channel_id=1, \
replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add.clone"""
# as XLA 0.10's CPU pipeline writes two combined row-split products (test_sharding)
COMBINED = """\
  ROOT %all-reduce.2 = (f32[4,32]{1,0}, f32[4,32]{1,0}) all-reduce(%ynn_fusion.1, \
%ynn_fusion), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=8] {'axis_1'}, \
use_global_device_ids=true, to_apply=%add.clone, metadata={op_name="jit(f)/dot_general"}"""
RENAMED = """\
  %combined.ar.7 = (bf16[2,8]{1,0}, f32[16]{0}, f32[]) all-reduce(bf16[2,8]{1,0} %a, \
f32[16]{0} %b, f32[] %c), replica_groups={{0,1},{2,3}}, to_apply=%sum"""
ASYNC = """\
  %all-reduce-start = f32[4,64]{1,0} all-reduce-start(f32[4,64]{1,0} %p), channel_id=3, \
replica_groups={{0,1,2,3}}, to_apply=%add
  %all-reduce-done = f32[4,64]{1,0} all-reduce-done(f32[4,64]{1,0} %all-reduce-start)"""
ASYNC_COMBINED = """\
  %all-reduce-start.1 = (f32[8]{0}, f32[2,3]{1,0}) all-reduce-start(f32[8]{0} %x, \
f32[2,3]{1,0} %y), channel_id=4, replica_groups={{0,1}}, to_apply=%add
  %all-reduce-done.1 = (f32[8]{0}, f32[2,3]{1,0}) all-reduce-done(\
(f32[8]{0}, f32[2,3]{1,0}) %all-reduce-start.1)"""
NOT_COLLECTIVES = """\
  %fusion.3 = f32[4,128]{1,0} fusion(f32[4,128]{1,0} %p), kind=kLoop, calls=%fused, \
metadata={op_name="jit(f)/all-reduce(x)"}
  %get-tuple-element.4 = f32[4,32]{1,0} get-tuple-element((f32[4,32]{1,0}, f32[4,32]{1,0}) \
%all-reduce.2), index=0
%add.clone (x: f32[], y: f32[]) -> f32[] {"""
GATHER = """\
  %all-gather-start = (f32[4,16]{1,0}, f32[4,128]{1,0}) all-gather-start(f32[4,16]{1,0} %q), \
channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}
  %all-gather-done = f32[4,128]{1,0} all-gather-done((f32[4,16]{1,0}, f32[4,128]{1,0}) \
%all-gather-start)"""

CASES = {  # text -> {op: [element count of each reduced or gathered array]}
    "plain": (PLAIN, {"all-reduce": [512]}),
    "combined": (COMBINED, {"all-reduce": [128, 128]}),
    "combined, renamed": (RENAMED, {"all-reduce": [16, 16, 1]}),
    "async pair": (ASYNC, {"all-reduce": [256]}),
    "async, combined": (ASYNC_COMBINED, {"all-reduce": [8, 6]}),
    "not collectives": (NOT_COLLECTIVES, {}),
    "async all-gather": (GATHER, {"all-gather": [512]}),
    "a module of them all": ("\n".join([PLAIN, COMBINED, RENAMED, ASYNC, ASYNC_COMBINED,
                                        NOT_COLLECTIVES, GATHER]),
                             {"all-reduce": [512, 128, 128, 16, 16, 1, 256, 8, 6],
                              "all-gather": [512]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_all_reduce_is_counted(case):
  text, want = CASES[case]
  assert mesh_worker.collectives(text) == want


# The counter before (the deliberate bug, committed): a regex whose shape is
# one word, so a tuple result (a combined all-reduce) never matches.
OLD = re.compile(r"= (\S+) (all-reduce|all-gather|all-to-all|collective-permute|"
                 r"reduce-scatter)(?:-start)?\(")


def old_collectives(compiled_text: str) -> dict[str, list[int]]:
  out: dict[str, list[int]] = {}
  for shape, op in OLD.findall(compiled_text):
    dims = re.findall(r"\[([\d,]*)\]", shape)
    sizes = [int(np.prod([int(d) for d in ds.split(",") if d] or [1])) for ds in dims]
    out.setdefault(op, []).append(max(sizes or [1]))
  return out


def miscounted(counter) -> list[str]:
  """The cases whose all-reduces `counter` counts wrong."""
  return [case for case, (text, want) in CASES.items()
          if len(counter(text).get("all-reduce", [])) != len(want.get("all-reduce", []))]


def test_the_counter_before_misses_combined_all_reduces():
  assert not miscounted(mesh_worker.collectives)
  assert {"combined", "combined, renamed", "async, combined"} <= set(
      miscounted(old_collectives)), miscounted(old_collectives)
