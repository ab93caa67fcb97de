"""What a batch step risks: the acceptance measured per draft position (`Tally`), the ways a
step may go and how fast each measured (`Gate`), and how many drafts each row verifies
(`choose_counts`, `choose_width`, `draft_chooser`). dflash.batch asks; nothing here runs a model.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

# The measured acceptance per position only changes while the drafter drafts: after PROBE_EVERY
# steps in a row that skipped it, one step drafts anyway (Gate), and older outcomes weigh less
# (each verified row scales its source's counts by FORGET), so the estimate follows the traffic.
# A probe that still finds drafting not worth it doubles the wait before the next, up to PROBE_MAX.
PROBE_EVERY = 16
PROBE_MAX = 256
FORGET = 0.995


class Tally:
    """Measured P(draft i accepted | drafts before it accepted) for one source of drafts, with a
    prior of 1/2 and old outcomes fading by FORGET per verified row."""

    def __init__(self, positions: int):
        self.tested = [0.0] * positions
        self.passed = [0.0] * positions

    def rates(self) -> list[float]:
        return [(a + 1) / (t + 2) for a, t in zip(self.passed, self.tested, strict=True)]

    def record(self, accepted: int, drafts: int) -> None:
        self.tested = [t * FORGET for t in self.tested]
        self.passed = [a * FORGET for a in self.passed]
        for i in range(min(accepted + 1, drafts)):  # position i was reached; accepted if < n
            self.tested[i] += 1
            self.passed[i] += i < accepted


class Gate:
    """A step has a bold way (run the drafter; verify lookup drafts) and a plain one; this
    measures the tokens per second of each per number of decoding rows and says which to take.

    The cost model predicts a step; this measures it whole (padding, Python, the LM-head rows of
    accepted drafts, a busy machine). The bold way runs when predicted to pay and not measured
    slower than the plain one at this many rows. While it does not, a probe takes it after
    PROBE_EVERY plain steps, waiting twice as long after each probe (up to PROBE_MAX); while it
    does and the plain way has fewer than PLAIN_SAMPLES counted steps at this many rows, a plain
    step follows every PLAIN_EVERY bold ones.

    A way's rate is its tokens over its seconds in its last WINDOW counted steps, less the
    slowest of them (a step the machine stalled must not decide for hundreds). Not a median of
    per-step rates: a drafting step's tokens are skewed (most steps of a weak drafter accept
    nothing, a few accept many), so its typical step is slower than plain decoding even where its
    throughput is higher. Not counted: each way's first step (it sets up kernels: the first
    drafter pass in a served process took 139 ms, later ones 6-12), and a step the caller marks
    as not representative (the drafter's first pass after the gate skipped it, which absorbs the
    context of every skipped step at once). A probe takes the bold way again until one of its
    steps counts, PROBE_STEPS at most. Drafting tends to pay less the more rows share a forward,
    so a bold way measured slower at some row count is taken to lose at every larger one too,
    until both ways have MEASURED counted steps at the larger count itself: then what it measured
    there decides. (A row count passed through while requests join or leave, 3 of a steady 4,
    gathers a few noisy steps and would otherwise veto every larger count for good: served, a
    lookup way measured 116 against 126 tok/s at 3 rows on 4 steps kept it off at 4 and 8 rows,
    where it measured 194 against 164 and 311 against 259.)"""

    WINDOW = 32
    MEASURED = 3  # counted steps of each way at a row count for its own verdict to stand
    PROBE_STEPS = 3
    # While the bold way runs, a plain step after every PLAIN_EVERY bold ones measures the plain
    # way at this many rows until it has PLAIN_SAMPLES counted steps: one plain step alone, slow
    # by chance, would keep a losing bold way running for the rest of the process.
    PLAIN_EVERY = 4
    PLAIN_SAMPLES = 8

    def __init__(self):
        # (rows, bold) -> (tokens, seconds) of its last WINDOW counted steps
        self.samples: dict[tuple[int, bool], deque[tuple[int, float]]] = {}
        self.plain_steps = self.bold_steps = 0  # in a row
        self.wait = PROBE_EVERY
        self.probing = 0  # bold steps left in the current probe
        self.warm: set[bool] = set()  # the ways whose first step has run

    def record(self, rows: int, bold: bool, tokens: int, seconds: float,
               counts: bool = True) -> None:
        if not counts:
            return
        if bold not in self.warm:  # the first: kernels set up, not counted
            self.warm.add(bold)
            return
        self.samples.setdefault((rows, bold), deque(maxlen=self.WINDOW)).append((tokens, seconds))
        if bold:
            self.probing = 0

    def rate(self, rows: int, bold: bool) -> float | None:
        """The way's measured tokens/s at this many rows, None if unmeasured: tokens over seconds
        of the window, less its slowest step once there are three."""
        samples = list(self.samples.get((rows, bold), ()))
        if len(samples) >= 3:
            samples.remove(max(samples, key=lambda sample: sample[1]))
        seconds = sum(s for _, s in samples)
        return sum(t for t, _ in samples) / seconds if seconds > 0 else None

    def loses(self, rows: int) -> bool:
        """Whether the bold way measured fewer tokens/s than the plain one at this many rows,
        once both have MEASURED counted steps here; before, at this many or at fewer."""
        if all(len(self.samples.get((rows, way), ())) >= self.MEASURED for way in (True, False)):
            return self.rate(rows, True) < self.rate(rows, False)
        for n in range(1, rows + 1):
            bold, plain = self.rate(n, True), self.rate(n, False)
            if bold is not None and plain is not None and bold < plain:
                return True
        return False

    def wins(self, rows: int) -> bool:
        """Whether the bold way measured more tokens/s than the plain one at this many rows or,
        unmeasured here, at the fewest rows above where both are measured (more rows favour it
        less), and lost at no fewer. Consulted, not counted: for a step whose seconds say nothing
        of either way (it also takes prompt chunks), which must neither explore nor probe."""
        for n in sorted({n for n, _ in self.samples if n >= rows}):
            bold, plain = self.rate(n, True), self.rate(n, False)
            if bold is not None and plain is not None:
                return bold > plain and not self.loses(rows)
        return False

    def bold(self, rows: int, predicted: bool) -> bool:
        """Whether this step takes the bold way (counted as taken)."""
        choice = predicted and not self.loses(rows)
        if self.probing:
            choice, self.probing = True, self.probing - 1
        elif choice:
            self.wait = PROBE_EVERY
            if len(self.samples.get((rows, False), ())) < self.PLAIN_SAMPLES \
                    and self.bold_steps >= self.PLAIN_EVERY:
                choice = False  # measure the plain way
        elif self.plain_steps >= self.wait:  # a probe: bold anyway, wait longer next time
            choice, self.wait = True, min(2 * self.wait, PROBE_MAX)
            self.probing = self.PROBE_STEPS - 1
        self.bold_steps, self.plain_steps = (self.bold_steps + 1, 0) if choice \
            else (0, self.plain_steps + 1)
        return choice


def choose_width(chances: Sequence[Sequence[float]], step_s: Callable[[int, int], float]) -> int:
    """Tokens per row (1 + drafts) of the batch's verify forward that maximise the batch's expected
    tokens per second: row r verifies min(width - 1, its drafts), draft i passing with probability
    chances[r][i] once those before it passed, and the forward over n rows of that width costs
    step_s(n, width). With one row it is dflash.draft_length's choice."""
    n = len(chances)
    longest = max((len(c) for c in chances), default=0)
    best_width, best_rate = 1, n / step_s(n, 1)
    survive = [1.0] * n
    expected = float(n)
    for width in range(2, longest + 2):
        for r, chance in enumerate(chances):
            if len(chance) >= width - 1:
                survive[r] *= chance[width - 2]
                expected += survive[r]
        rate = expected / step_s(n, width)
        if rate > best_rate:
            best_width, best_rate = width, rate
    return best_width


def choose_counts(chances: Sequence[Sequence[float]],
                  step_s: Callable[[int, float], float]) -> list[int]:
    """Drafts per row (row r verifies its first counts[r]) that maximise the batch's expected
    tokens per second when the rows' tokens are packed into one forward: n rows verifying m
    drafts in all cost step_s(n, (n + m) / n), the seconds of n rows of that mean width. Each
    draft adds its chance of being reached and accepted (the product of its row's chances up to
    it), which never grows along a row, so the best m drafts are the m largest additions, taken
    in order; with one row it is dflash.draft_length's choice."""
    n = len(chances)
    gains = []  # (expected tokens the draft adds, its row), row by row in draft order
    for r, chance in enumerate(chances):
        survive = 1.0
        for c in chance:
            survive *= c
            gains.append((survive, r))
    gains.sort(key=lambda gain: -gain[0])  # stable: a row's equal gains stay in its order
    best, best_rate, expected = 0, n / step_s(n, 1), float(n)
    for m, (gain, _) in enumerate(gains, start=1):
        expected += gain
        rate = expected / step_s(n, (n + m) / n)
        if rate > best_rate:
            best, best_rate = m, rate
    counts = [0] * n
    for _, r in gains[:best]:
        counts[r] += 1
    return counts


def draft_chooser(step_s: Callable[[int, float], float], verify_s: Callable[[int, float], float],
                  packed: bool) -> Callable[[list[list[float]], bool], list[int]]:
    """BatchDecoder's `choose` from a cost model (seconds of a forward over `rows` rows of a
    mean `width` tokens): `choose_counts` for a target that packs, `choose_width` for one that
    pads every row to the widest. The drafter pass is counted in the step's seconds only when the
    drafter ran this step: a step that verifies lookup drafts alone pays no drafter pass, and one
    counted in every width's cost would make a wider verify look cheaper beside a plain one than
    it is (at 8 rows here: 1.33x the seconds of width 1 for width 3 instead of 1.42x)."""
    def choose(chances: list[list[float]], drafted: bool) -> list[int]:
        cost = step_s if drafted else verify_s
        if packed:
            return choose_counts(chances, cost)
        width = choose_width(chances, cost)
        return [min(width - 1, len(c)) for c in chances]
    return choose
