# Included by the *_vs_torch.sh drivers' tables: jq -rs -L benchmarks 'include "table"; ...'

# The number with exactly d decimals, rounded half away from zero: 1.5 | f(2) is "1.50".
def f(d): (. * pow(10; d) | round | tostring) as $s | ("0" * (d + 1 - ($s | length)) + $s)
  | if d == 0 then . else .[:length - d] + "." + .[length - d:] end;

# Which side a result line came from: "pytorch" or "paratrain".
def side: if .implementation == "pytorch" then "pytorch" else "paratrain" end;
