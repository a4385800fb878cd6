"""tools/fidelity_report.py on a reduced set of rows: it runs, its table parses, flagged rows carry
their reason, and every row of the full report names an existing config."""
import re
import runpy

import pytest

TOOL = runpy.run_path('tools/fidelity_report.py', run_name='fidelity_report')


def test_every_row_has_a_config():
    missing = [r[0] for r in TOOL['ROWS'] if TOOL['find_config'](r[0]) is None]
    assert not missing


def test_reduced_report_parses(tmp_path):
    out = tmp_path / 'fidelity.md'
    names = ['deit-t_in1k', 'pola-pvt-t_in1k', 'poly-deit-t_in1k']
    assert TOOL['main'](['--out', str(out), '--only'] + names) == 0
    text = out.read_text()
    assert text.startswith('# Fidelity report')
    assert '`python tools/fidelity_report.py --only deit-t_in1k' in text
    rows = {}
    for line in text.splitlines():
        m = re.match(r'\| `configs/\w+/([\w.-]+)\.py` \| [\w-]+ \| ([\d.]+) / ([\d.]+) \| '
                     r'([+-][\d.]+%) \| ([\d.]+) / ([\d.–]+) \|', line)
        if m:
            rows[m.group(1)] = [m.group(i) for i in range(2, 7)]
    assert set(rows) == set(names)
    assert rows['deit-t_in1k'][:2] == ['5.72', '5.7'] and rows['deit-t_in1k'][3] == '1.25'
    assert rows['pola-pvt-t_in1k'][:2] == ['12.92', '12']
    assert rows['poly-deit-t_in1k'][4] == '–'  # the paper gives attention-only FLOPs
    assert '⚑ [1]' in text and 'paper params are truncated' in text  # pola-pvt-t's reason
    assert 'UNEXPLAINED' not in text


def test_regenerating_keeps_the_learning_check_section(tmp_path):
    out = tmp_path / 'fidelity.md'
    section = ('<!-- learning-check:begin -->\n## Learning check on the demo data\n| a | 0.100 |\n'
               '<!-- learning-check:end -->')
    out.write_text('# Fidelity report\nold table\n\n' + section + '\n')
    assert TOOL['main'](['--out', str(out), '--only', 'deit-t_in1k']) == 0
    text = out.read_text()
    assert 'old table' not in text and '`configs/deit/deit-t_in1k.py`' in text
    assert text.count(section) == 1 and text.index('## Equivalence') < text.index(section)


def test_unexplained_rows_fail_the_tool(tmp_path, monkeypatch):
    rows = [r if r[0] != 'pola-pvt-t_in1k' else r[:5] + (None, ) for r in TOOL['ROWS']]
    main = TOOL['main']
    monkeypatch.setitem(main.__globals__, 'ROWS', rows)
    out = tmp_path / 'f.md'
    assert main(['--out', str(out), '--only', 'pola-pvt-t_in1k']) == 1
    assert 'UNEXPLAINED' in out.read_text()


@pytest.mark.parametrize('value,expected', [(None, '–'), (0.0123, '+1.2%'), (-0.05, '-5.0%')])
def test_percent_format(value, expected):
    assert TOOL['_pct'](value) == expected


def test_unknown_or_partial_rows_do_not_replace_the_doc_table(tmp_path, capsys):
    """--only with a name of no row is an error that lists the rows (it wrote an empty table),
    and --only without --out is refused: a partial table would replace docs/fidelity.md's."""
    with pytest.raises(SystemExit):
        TOOL['main'](['--out', str(tmp_path / 'f.md'), '--only', 'nosuch_in1k'])
    assert "unknown config name(s) ['nosuch_in1k']; the rows: " in capsys.readouterr().err
    assert not (tmp_path / 'f.md').exists()
    with pytest.raises(SystemExit):
        TOOL['main'](['--only', 'deit-t_in1k'])
    assert 'give --out FILE' in capsys.readouterr().err
