"""benchmark/common.py's repeated runs (compare_llamacpp.py --repeats): the sides in alternating order, and a
side's runs folded, each section from the run where its figure was best, every run's figures (and other
values asked for) listed, failed runs kept but never chosen."""
from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmark')
sys.path.insert(0, BENCH)
from common import alternating, best_of_runs  # noqa: E402

FIGURES = {'decode': lambda r: (r.get('decode') or {}).get('tok_s'),
           'prefill': lambda r: (r.get('prefill') or {}).get('tok_s')}


def run(decode, prefill, **extra):
    return {'decode': {'tok_s': decode, 'rounds': [decode]}, 'prefill': {'tok_s': prefill}, **extra}


def test_each_section_comes_from_the_run_where_it_was_best():
    runs = [run(200.0, 700.0, tag='first', bw=31.0), run(231.0, 650.0, tag='second', bw=50.0),
            {'error': 'worker died'}, run(219.0, 720.0, tag='fourth', bw=33.0)]
    best = best_of_runs(runs, FIGURES, {'bw': lambda r: r['bw']})
    assert best['decode'] == {'tok_s': 231.0, 'rounds': [231.0]}  # the section, whole, from run 2
    assert best['prefill'] == {'tok_s': 720.0}                    # from run 4
    assert best['tag'] == 'first' and best['bw'] == 31.0  # everything else: the first run that worked
    assert best['runs'][:2] == [{'decode': 200.0, 'prefill': 700.0, 'bw': 31.0},
                                {'decode': 231.0, 'prefill': 650.0, 'bw': 50.0}]
    assert best['runs'][2] == {'error': 'worker died'} and best['runs'][3]['prefill'] == 720.0
    assert 'error' not in best


def test_one_run_or_only_failures_pass_through():
    only = run(100.0, 300.0)
    assert best_of_runs([only], FIGURES) is only
    failed = [{'error': 'a'}, {'error': 'b'}]
    assert best_of_runs(failed, FIGURES) == {'error': 'a'}


def test_a_section_no_run_has_stays_absent():
    runs = [{'decode': {'tok_s': 1.0}}, {'decode': {'tok_s': 2.0}}]
    best = best_of_runs(runs, FIGURES)
    assert best['decode'] == {'tok_s': 2.0} and 'prefill' not in best
    assert best['runs'] == [{'decode': 1.0, 'prefill': None}, {'decode': 2.0, 'prefill': None}]


def test_alternating_reverses_the_order_every_other_repeat():
    assert list(alternating(['a', 'b', 'c'], 3)) == [(0, 'a'), (0, 'b'), (0, 'c'), (1, 'c'), (1, 'b'), (1, 'a'),
                                                      (2, 'a'), (2, 'b'), (2, 'c')]
    assert list(alternating(['a'], 0)) == []
