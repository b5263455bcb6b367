# Included by the drivers' tables (the *_vs_torch.sh ones, deterministic.sh): jq -rs -L benchmarks 'include "table"; ...'

# The number with exactly d decimals, rounded half away from zero: 1.5 | f(2) is "1.50".
def f(d): (. * pow(10; d) | round | tostring) as $s | ("0" * (d + 1 - ($s | length)) + $s)
  | if d == 0 then . else .[:length - d] + "." + .[length - d:] end;

# Which side a result line came from: "pytorch" or "paratrain".
def side: if .implementation == "pytorch" then "pytorch" else "paratrain" end;

# The median of an array of numbers (the mean of the middle two for an even count).
def median: sort | if length % 2 == 1 then .[length / 2 | floor] else (.[length / 2 - 1] + .[length / 2]) / 2 end;
