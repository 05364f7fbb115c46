"""Needle samples, in one place: the text format, the draws, the evaluations' token-exact prompt and the
training mixtures' documents.

One needle is the sentence " The special magic {city} number is: {number}." (the template of the
paper authors' group; LWM's 7-digit numbers by default). The `needle` task and the attention-noise
and logit-quant probes (eval/) score prompts made by `needle_prompt`; the training mixture
(data/mixture.py) appends documents made by `needle_document` and `needles_only_document`. Both draw
cities and numbers, filler needles and the question by the same functions, so a model trained on a
mixture has seen the exact wording it is tested on. This module lives in `data` because `data` may
import only the base modules: the mixture cannot import `eval`, while `eval` may import `data`.

`needle_prompt` builds one multi-needle retrieval prompt AT TOKEN LEVEL, so every offset is exact:

    [EOS] instruction | context: haystack with N needles, the answer needle at `depth` | question

- BOS: the tokenizer's EOS id, as `eval/lm.encode_prompt` starts every scored text (a document
  starts here, as in training).
- instruction: INSTRUCTION (the LWM wording) followed by a newline.
- context: everything between the instruction and the question. The answer needle (the first
  queried city's) starts at context offset round(depth / 100 * (C - L)), C the context's length and
  L the needle's, all in tokens: depth 0 opens the context, depth 100 ends it right before the
  question. The other N - 1 needles lie wholly before or wholly after it, at random places; the
  rest is haystack:
  * "text": a contiguous window of held-out tokens (`HeldoutText`: a split of a prepared corpus, never
    train), EOS ids removed (an EOS mid-prompt would tell the model a new document starts), cut in two
    by the answer needle. Needles go between any two haystack tokens (a word may be split: exact
    depths matter more than pretty text).
  * "needles" (RULER niah_multikey_2): the haystack is only further needles of the same template,
    each with its own city and number ("fillers"); a side whose token budget no whole needle fills
    exactly is padded with single newline tokens at random places between needles. Fillers are
    not among the N: they are distractors for greedy decoding, not forced-choice candidates.
- question: R = 1: "What is the special magic {city} number? The special magic {city} number is"
  (completion style). R > 1: "What are the special magic numbers for {c1}, and {c2}?" (cities in
  random order; three or more read "c1, c2, and c3"), and each queried city gets its own prompt
  ending with the cue " The special magic {ci} number is", so every queried city is scored by
  the same completion (greedy or forced choice). `ids` is the prompt of the first queried city,
  whose needle sits at `depth`; the other queried needles are among the N - 1 others.
- Pieces are tokenised separately and concatenated (the pieces start at a space or newline, where
  byte-level BPE splits anyway), so segment spans are exact; decode(ids) reads as the text.
- Cities and numbers are distinct within a sample, numbers have exactly `digits` digits, and each
  number occurs exactly once in the decoded prompt (a draw colliding with haystack text is drawn
  again), so every answer is recoverable from its prompt and the substring check is unambiguous.
  The N needles' numbers (the forced-choice candidates) also have one token count, so their summed
  log-probabilities compare like with like and a model without preference ties (`draw_needles`).

`length` is the exact token count of `ids`, BOS and question included. The other queried cities'
prompts differ only by their city's tokens in the cue (`cue_slack` bounds the difference).

Training documents (text, about `length` tokens with their EOS; data/mixture.py sizes them):
- `needle_document`: [instruction][train haystack with k needles at random token positions][question]
  [answers]; k uniform in 1..max_needles, R queried cities uniform in 1..min(k, MAX_QUERIES). R = 1:
  QUESTION_ONE + " {number}." R > 1: QUESTION_MANY (cities shuffled), then for each queried city its
  CUE + " {number}." (`answered_question`): the completion every evaluation prompt ends in, answered.
- `needles_only_document`: [instruction][needles only, each its own city and number][question][answers]
  (the evaluation's haystack "needles"); as many whole needles as fill the length.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

# ------------------------------------------------------------------------------------------- format

INSTRUCTION = ("There is a special magic number inside a lot of irrelevant text. Find it and memorize them. "
               "I will quiz you about the magic number there.\n")
NEEDLE_HEAD = " The special magic {city} number is:"  # + " {number}" + NEEDLE_TAIL
NEEDLE_TAIL = "."
QUESTION_ONE = "\nWhat is the special magic {city} number? The special magic {city} number is"
QUESTION_MANY = "\nWhat are the special magic numbers for {cities}?"
CUE = " The special magic {city} number is"
HAYSTACKS = ("text", "needles")
PAD = "\n"  # what fills a needles-only side that no whole needle fills exactly
MAX_FILLER_MISSES = 8  # filler draws in a row that do not fit before a needles-only side stops drawing
DOCUMENT_DIGITS = 7  # a training document's numbers: the needle task's default (LWM's 7-digit numbers)
MAX_QUERIES = 2  # R per training document: the needle task's default grid asks 1 or 2 cities
DOCUMENT_ATTEMPTS = 50  # draws per training document before giving up with the reason

CITIES: tuple[str, ...] = (
    # Europe
    "Amsterdam", "Athens", "Barcelona", "Belgrade", "Berlin", "Bern", "Bilbao", "Birmingham", "Bologna", "Bordeaux",
    "Bratislava", "Bremen", "Brno", "Brussels", "Bucharest", "Budapest", "Cardiff", "Cologne", "Copenhagen", "Cork",
    "Dortmund", "Dresden", "Dublin", "Dusseldorf", "Edinburgh", "Florence", "Frankfurt", "Gdansk", "Geneva", "Genoa",
    "Glasgow", "Gothenburg", "Graz", "Hamburg", "Hanover", "Helsinki", "Innsbruck", "Istanbul", "Kyiv", "Krakow",
    "Leeds", "Leipzig", "Lille", "Lisbon", "Liverpool", "Ljubljana", "London", "Lyon", "Madrid", "Malaga",
    "Manchester", "Marseille", "Milan", "Minsk", "Monaco", "Moscow", "Munich", "Nantes", "Naples", "Nice",
    "Nuremberg", "Oslo", "Palermo", "Paris", "Porto", "Prague", "Reykjavik", "Riga", "Rome", "Rotterdam",
    "Salzburg", "Sarajevo", "Seville", "Sofia", "Stockholm", "Strasbourg", "Stuttgart", "Tallinn", "Tirana",
    "Toulouse", "Turin", "Utrecht", "Valencia", "Venice", "Vienna", "Vilnius", "Warsaw", "Zagreb", "Zurich",
    "Antwerp", "Bergen", "Aarhus", "Basel", "Lausanne", "Odessa", "Kharkiv", "Thessaloniki", "Valletta", "Nicosia",
    "Skopje", "Podgorica", "Chisinau", "Belfast", "Bristol", "Sheffield", "Newcastle", "Nottingham", "Aberdeen",
    "Grenoble", "Montpellier", "Rennes", "Bonn", "Mainz", "Ghent", "Bruges", "Eindhoven", "Groningen", "Tampere",
    "Turku", "Uppsala", "Malmo", "Trondheim", "Stavanger", "Wroclaw", "Poznan", "Lodz", "Debrecen", "Cluj", "Varna",
    "Plovdiv", "Split", "Dubrovnik", "Salamanca", "Granada", "Cordoba", "Zaragoza", "Pisa", "Verona", "Siena",
    "Bari", "Catania", "Trieste",
    # Asia
    "Tokyo", "Osaka", "Kyoto", "Nagoya", "Sapporo", "Fukuoka", "Yokohama", "Kobe", "Hiroshima", "Sendai", "Seoul",
    "Busan", "Incheon", "Daegu", "Beijing", "Shanghai", "Guangzhou", "Shenzhen", "Chengdu", "Wuhan", "Xian",
    "Nanjing", "Hangzhou", "Tianjin", "Chongqing", "Harbin", "Kunming", "Qingdao", "Dalian", "Xiamen", "Taipei",
    "Kaohsiung", "Hong Kong", "Macau", "Manila", "Cebu", "Hanoi", "Saigon", "Da Nang", "Bangkok", "Chiang Mai",
    "Phuket", "Vientiane", "Phnom Penh", "Yangon", "Mandalay", "Kuala Lumpur", "Penang", "Singapore", "Jakarta",
    "Surabaya", "Bandung", "Denpasar", "Medan", "Dhaka", "Chittagong", "Kathmandu", "Thimphu", "Colombo", "Kandy",
    "Mumbai", "Delhi", "Kolkata", "Chennai", "Bangalore", "Hyderabad", "Pune", "Ahmedabad", "Jaipur", "Lucknow",
    "Kochi", "Agra", "Varanasi", "Karachi", "Lahore", "Islamabad", "Peshawar", "Kabul", "Herat", "Tashkent",
    "Samarkand", "Bukhara", "Almaty", "Astana", "Bishkek", "Dushanbe", "Ashgabat", "Tehran", "Isfahan", "Shiraz",
    "Tabriz", "Baghdad", "Basra", "Mosul", "Erbil", "Damascus", "Aleppo", "Beirut", "Amman", "Jerusalem", "Haifa",
    "Riyadh", "Jeddah", "Mecca", "Medina", "Doha", "Dubai", "Abu Dhabi", "Muscat", "Manama", "Sanaa", "Aden",
    "Ankara", "Izmir", "Antalya", "Bursa", "Tbilisi", "Yerevan", "Baku", "Ulaanbaatar", "Lhasa", "Urumqi",
    # Africa
    "Cairo", "Alexandria", "Luxor", "Aswan", "Khartoum", "Addis Ababa", "Nairobi", "Mombasa", "Kampala", "Kigali",
    "Dar es Salaam", "Zanzibar", "Lusaka", "Harare", "Maputo", "Gaborone", "Windhoek", "Johannesburg", "Pretoria",
    "Durban", "Cape Town", "Lagos", "Abuja", "Kano", "Ibadan", "Accra", "Kumasi", "Dakar", "Bamako", "Niamey",
    "Ouagadougou", "Abidjan", "Conakry", "Freetown", "Monrovia", "Lome", "Cotonou", "Douala", "Yaounde",
    "Libreville", "Kinshasa", "Brazzaville", "Luanda", "Tunis", "Algiers", "Oran", "Tripoli", "Benghazi", "Rabat",
    "Casablanca", "Marrakesh", "Fez", "Tangier", "Nouakchott", "Antananarivo", "Mogadishu", "Djibouti", "Asmara",
    "Lilongwe", "Blantyre", "Bulawayo",
    # Americas
    "Chicago", "Houston", "Phoenix", "Philadelphia", "San Antonio", "San Diego", "Dallas", "Austin", "Seattle",
    "Denver", "Boston", "Detroit", "Nashville", "Memphis", "Portland", "Baltimore", "Milwaukee", "Albuquerque",
    "Tucson", "Fresno", "Sacramento", "Atlanta", "Miami", "Tampa", "Orlando", "Pittsburgh", "Cincinnati",
    "Cleveland", "Minneapolis", "Omaha", "Honolulu", "Anchorage", "Las Vegas", "Los Angeles", "San Francisco",
    "New Orleans", "Charlotte", "Raleigh", "Richmond", "Buffalo", "Boise", "Spokane", "Savannah", "Louisville",
    "Indianapolis", "Columbus", "Oklahoma City", "Kansas City", "Salt Lake City", "Saint Louis", "Toronto",
    "Montreal", "Vancouver", "Calgary", "Edmonton", "Ottawa", "Winnipeg", "Halifax", "Quebec City", "Regina",
    "Saskatoon", "Victoria", "Mexico City", "Guadalajara", "Monterrey", "Puebla", "Tijuana", "Cancun", "Oaxaca",
    "Merida", "Havana", "Kingston", "Santo Domingo", "San Juan", "Port-au-Prince", "Guatemala City", "San Salvador",
    "Tegucigalpa", "Managua", "San Jose", "Panama City", "Bogota", "Medellin", "Cali", "Cartagena", "Caracas",
    "Maracaibo", "Quito", "Guayaquil", "Lima", "Cusco", "Arequipa", "La Paz", "Santa Cruz", "Sucre", "Santiago",
    "Valparaiso", "Buenos Aires", "Rosario", "Mendoza", "Montevideo", "Asuncion", "Sao Paulo", "Rio de Janeiro",
    "Brasilia", "Recife", "Fortaleza", "Belo Horizonte", "Manaus", "Curitiba", "Belem", "Paramaribo", "Georgetown",
    "Cayenne",
    # Oceania
    "Sydney", "Melbourne", "Brisbane", "Perth", "Adelaide", "Hobart", "Darwin", "Canberra", "Auckland", "Wellington",
    "Christchurch", "Suva", "Apia", "Noumea", "Port Moresby",
)


def question_text(queried: Sequence[str]) -> str:
    """The question after the haystack: R = 1 completion style, R > 1 the "What are ..." form."""
    if len(queried) == 1:
        return QUESTION_ONE.format(city=queried[0])
    cities = ", ".join(queried[:-1]) + ", and " + queried[-1]
    return QUESTION_MANY.format(cities=cities)


def needle_sentence(city: str, number: str) -> str:
    """One needle as text: NEEDLE_HEAD, " {number}", NEEDLE_TAIL (the pieces `needle_tokens` encodes)."""
    return NEEDLE_HEAD.format(city=city) + " " + number + NEEDLE_TAIL


def answered_question(queried: Sequence[str], numbers: dict[str, str], rng: random.Random) -> str:
    """The question and its answers: R = 1 QUESTION_ONE + " {number}.", R > 1 QUESTION_MANY (cities
    shuffled by `rng`) then each city's CUE + " {number}."."""
    if len(queried) == 1:
        return question_text(queried) + f" {numbers[queried[0]]}{NEEDLE_TAIL}"
    shown = list(queried)
    rng.shuffle(shown)
    return question_text(shown) + "".join(CUE.format(city=c) + f" {numbers[c]}{NEEDLE_TAIL}" for c in queried)


# -------------------------------------------------------------------------------------------- draws


def pick_cities(rng: random.Random, count: int, exclude: Sequence[str] = ()) -> list[str]:
    """`count` distinct cities not in `exclude`, in random order."""
    excluded = set(exclude)
    pool = [c for c in CITIES if c not in excluded]
    if count > len(pool):
        raise ValueError(f"{count} distinct cities are needed but only {len(pool)} are left of the {len(CITIES)} in "
                         f"difftransformer.data.needle.CITIES; use fewer needles or a shorter needles-only haystack")
    return rng.sample(pool, count)


def draw_number(rng: random.Random, digits: int, taken: set[str]) -> str:
    """A `digits`-digit number (no leading zero) not in `taken`; added to `taken`."""
    space = 9 * 10 ** (digits - 1)
    if len(taken) >= space:
        raise ValueError(f"all {space} numbers of {digits} digits are taken; use more digits")
    while True:
        number = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if number not in taken:
            taken.add(number)
            return number


SIZED_ATTEMPTS = 1000  # draws per number before a prompt's numbers of one token count are given up on


def draw_needles(rng: random.Random, count: int, digits: int, size: Callable[[str], int] | None = None
                 ) -> tuple[list[str], list[str], set[str]] | None:
    """(cities, their numbers, the set of those numbers): `count` distinct cities, then one distinct
    `digits`-digit number per city, in that order.

    size: None, or a number's size (its token count): every number then has the first's size, redrawn up to
    SIZED_ATTEMPTS times each (None when one cannot be found). An evaluation's forced choice sums each
    candidate's token log-probabilities, so candidates of unequal token counts would be told apart by their
    count (each extra token costs up to log V nats) before any preference, and a model without one would not
    score chance exactly."""
    cities = pick_cities(rng, count)
    taken: set[str] = set()
    numbers = [draw_number(rng, digits, taken)]
    wanted = None if size is None else size(numbers[0])
    for _ in cities[1:]:
        for _ in range(SIZED_ATTEMPTS):
            number = draw_number(rng, digits, taken)
            if wanted is None or size(number) == wanted:
                numbers.append(number)
                break
            taken.discard(number)
        else:
            return None
    return cities, numbers, taken


T = TypeVar("T")


def draw_fillers(rng: random.Random, budget: int, digits: int, taken: set[str], used: set[str],
                 make: Callable[[str, str], tuple[T, int]]) -> tuple[list[tuple[str, str, T]], int]:
    """Filler needles for a needles-only haystack of `budget` units, and the units left over.

    Each draw is a city not in `used` and a number not in `taken`; `make(city, number)` returns the
    needle as the caller writes it and its size (tokens). A needle that fits is kept ((city, number,
    made); its city joins `used`, its number stays in `taken`); one that does not is dropped (its number
    leaves `taken`), and drawing stops after MAX_FILLER_MISSES such draws in a row or when nothing is left."""
    out: list[tuple[str, str, T]] = []
    left, misses = budget, 0
    while left > 0 and misses < MAX_FILLER_MISSES:
        city = pick_cities(rng, 1, exclude=used)[0]
        number = draw_number(rng, digits, taken)
        made, size = make(city, number)
        if size <= left:
            used.add(city)
            out.append((city, number, made))
            left -= size
            misses = 0
        else:
            taken.discard(number)
            misses += 1
    return out, left


# ------------------------------------------------------------------------------------------- tokens

_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {key: value}, dropped with it


def _memo(tokenizer, key: tuple, compute: Callable[[], Any]):
    """compute(), once per tokenizer and key: for what depends only on the tokenizer and the fixed
    templates (a template's tokens for one city, the length bounds), which every prompt would
    otherwise encode again (min_prompt_length alone encodes every city). Encoding is deterministic,
    so the ids are the ones a fresh encode gives. A tokenizer that cannot be weakly referenced is
    simply not memoised."""
    try:
        memo = _MEMO.setdefault(tokenizer, {})
    except TypeError:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def template_ids(tokenizer, text: str) -> list[int]:
    """tokenizer.encode(text) for a fixed template string (memoised per tokenizer; a fresh list)."""
    return list(_memo(tokenizer, ("encode", text), lambda: tuple(tokenizer.encode(text))))


def check_pieces(tokenizer) -> None:
    """ValueError unless the prompt's pieces, encoded apart, read as their text (they decode as the whole text's
    tokens do; memoised per tokenizer). A prompt is laid down piece by piece so that every span is exact. A byte-level
    BPE reads the same either way, though a pre-tokenizer that joins "." and a following newline (Llama 3's, cl100k)
    gives other ids at that junction; a SentencePiece-style tokenizer that adds a prefix space to every call (Llama 2,
    Mistral v0.1) would give the model "1234567 ." and stray spaces instead: refused, not scored."""
    city, other = CITIES[0], CITIES[1]
    pieces = (INSTRUCTION, NEEDLE_HEAD.format(city=city), " 1234567", NEEDLE_TAIL, NEEDLE_HEAD.format(city=other),
              " 7654321", NEEDLE_TAIL, question_text([city]), question_text([other, city]), CUE.format(city=city))

    def reads_alike() -> bool:
        apart = [t for piece in pieces for t in template_ids(tokenizer, piece)]
        return tokenizer.decode(apart) == tokenizer.decode(tokenizer.encode("".join(pieces)))

    if not _memo(tokenizer, ("pieces read alike",), reads_alike):
        raise ValueError("this tokenizer's needle-prompt pieces, encoded apart, do not read as their text (it adds a "
                         "prefix space to every call, as SentencePiece tokenizers such as Llama 2's do), so the model "
                         "would not read the prompt the task states; needle prompts need a tokenizer whose pieces "
                         "concatenate, such as a byte-level BPE")


def number_ids(tokenizer, number: str) -> list[int]:
    """A number's tokens as a needle states it and forced choice scores it: " {number}"."""
    return tokenizer.encode(" " + number)


def needle_tokens(tokenizer, city: str, number: str) -> tuple[list[int], int, int]:
    """(tokens of the needle sentence, number start, number end) with the number span exact."""
    head = template_ids(tokenizer, NEEDLE_HEAD.format(city=city))
    num = number_ids(tokenizer, number)
    return head + num + template_ids(tokenizer, NEEDLE_TAIL), len(head), len(head) + len(num)


def cue_slack(tokenizer) -> int:
    """How many more tokens one city's R > 1 cue can take than another's (a bound over CITIES)."""
    lengths = [len(template_ids(tokenizer, CUE.format(city=c))) for c in CITIES]
    return max(lengths) - min(lengths)


def min_prompt_length(tokenizer, needles: int, queries: int, digits: int, typical: bool = False) -> int:
    """The shortest prompt that can hold `needles` needles and the question for `queries` cities,
    from the cities shortest in tokens and one-token numbers (a bound: shorter never fits). With
    `typical`: from median cities and the median number, plus haystack as long as the longest
    needle, so that most draws fit at every depth (when the haystack is at least one needle long,
    the other needles can always be split around the answer at its exact offset). Memoised per tokenizer."""
    return _memo(tokenizer, ("min_prompt_length", needles, queries, digits, typical),
                 lambda: _min_prompt_length(tokenizer, needles, queries, digits, typical))


def _min_prompt_length(tokenizer, needles: int, queries: int, digits: int, typical: bool) -> int:
    by_length = sorted(CITIES, key=lambda c: (len(template_ids(tokenizer, NEEDLE_HEAD.format(city=c))), c))
    if typical:
        mid = len(by_length) // 2
        cities = by_length[mid - needles // 2:][:needles]
        rng = random.Random(0)
        sizes = sorted(len(number_ids(tokenizer, str(rng.randrange(10 ** (digits - 1), 10 ** digits))))
                       for _ in range(64))
        number = sizes[len(sizes) // 2]
    else:
        cities, number = by_length[:needles], 1
    heads = sum(len(template_ids(tokenizer, NEEDLE_HEAD.format(city=c))) for c in cities)
    needle = heads + needles * (number + len(template_ids(tokenizer, NEEDLE_TAIL)))
    asked = cities[:queries]
    question = len(tokenizer.encode(question_text(asked)))
    if queries > 1:
        question += len(template_ids(tokenizer, CUE.format(city=asked[0])))
    slack = longest_needle(tokenizer, digits) if typical else 0
    return 1 + len(template_ids(tokenizer, INSTRUCTION)) + question + needle + slack


def longest_needle(tokenizer, digits: int) -> int:
    """A bound on one needle's tokens: the longest city and digits + 1 number tokens."""
    head = max(len(template_ids(tokenizer, NEEDLE_HEAD.format(city=c))) for c in CITIES)
    return head + digits + 1 + len(template_ids(tokenizer, NEEDLE_TAIL))


# ------------------------------------------------------------------------------------------- sample


@dataclass(frozen=True)
class Segments:
    """Token spans [start, end) of a prompt's five segments; they tile [0, len(ids)).

    `number` lies inside `answer` (the number tokens of the answer needle, leading space included);
    a probe that takes the number as "the answer" counts the rest of the sentence as context."""

    bos: tuple[int, int]
    before: tuple[int, int]  # instruction and context before the answer needle
    answer: tuple[int, int]  # the whole answer needle sentence
    number: tuple[int, int]  # its number tokens only
    after: tuple[int, int]  # context after the answer needle
    query: tuple[int, int]  # the question (through the completion cue)


@dataclass(frozen=True)
class Needle:
    city: str
    number: str
    span: tuple[int, int]  # the sentence's tokens in the prompt
    number_span: tuple[int, int]  # the number's tokens in the prompt
    filler: bool  # part of a needles-only haystack, not one of the N needles


@dataclass(frozen=True)
class NeedleSample:
    """One retrieval prompt; see the module doc. Token lists are tuples (hashable, immutable)."""

    ids: tuple[int, ...]  # the prompt of queried[0], exactly `length` tokens
    prompts: tuple[tuple[int, ...], ...]  # one prompt per queried city; prompts[0] == ids
    queried: tuple[str, ...]  # the R queried cities; queried[0]'s needle is at `depth`
    targets: tuple[str, ...]  # their numbers, in the same order
    needles: tuple[Needle, ...]  # every needle of the prompt (fillers included), in prompt order
    candidate_ids: tuple[tuple[int, ...], ...]  # tokens of " {number}" for each candidate, as `candidates`
    segments: Segments  # of `ids`
    depth: float
    length: int
    haystack: str
    source_offset: int | None  # "text": where the haystack window starts in the EOS-free held-out tokens
    context_start: int  # where the context (haystack and needles) begins: after BOS and the instruction

    @property
    def candidates(self) -> tuple[str, ...]:
        """The N needles' numbers (fillers excluded), in prompt order: the forced-choice options."""
        return tuple(n.number for n in self.needles if not n.filler)

    @property
    def target_index(self) -> tuple[int, ...]:
        """Index of each target in `candidates`."""
        return tuple(self.candidates.index(t) for t in self.targets)

    def haystack_ids(self) -> list[int]:
        """The prompt's haystack tokens: the context without the N needles (fillers included)."""
        inside = {i for n in self.needles if not n.filler for i in range(*n.span)}
        return [self.ids[i] for i in range(self.context_start, self.segments.query[0]) if i not in inside]


class HeldoutText:
    """The tokens of a held-out split with EOS ids removed: where "text" haystacks come from
    (eval/tasks/needle.haystack_text reads them from a prepared-data folder)."""

    def __init__(self, tokens: Sequence[int] | np.ndarray, eos_id: int, name: str = "held-out tokens"):
        arr = np.asarray(tokens)
        self.tokens = arr[arr != eos_id]
        self.name = name

    def window(self, rng: random.Random, n: int) -> tuple[int, list[int]]:
        """(offset, n contiguous tokens) at a random offset; a ValueError when the split is too short."""
        if n > len(self.tokens):
            raise ValueError(f"a needle haystack needs {n} tokens of held-out text but {self.name} has only "
                             f"{len(self.tokens)}; use shorter lengths or haystack 'needles'")
        start = rng.randrange(len(self.tokens) - n + 1)
        return start, [int(t) for t in self.tokens[start:start + n]]


# ------------------------------------------------------------------------------------------- layout


def _assign_sides(rng: random.Random, lengths: list[int], before: int, after: int) -> list[bool] | None:
    """For each needle length, True = before the answer, so that each side's needles fit its budget;
    None when no assignment fits. Random greedy tries first (sides chosen in proportion to their room),
    then every subset when there are few needles."""
    for _ in range(64):
        sides = _greedy_sides(rng, lengths, before, after)
        if sides is not None:
            return sides
    if len(lengths) <= 16:
        total = sum(lengths)
        options = [mask for mask in range(1 << len(lengths))
                   if (b := sum(n for i, n in enumerate(lengths) if mask >> i & 1)) <= before and total - b <= after]
        if options:
            mask = rng.choice(options)
            return [bool(mask >> i & 1) for i in range(len(lengths))]
    return None


def _greedy_sides(rng: random.Random, lengths: list[int], before: int, after: int) -> list[bool] | None:
    """One random greedy try of `_assign_sides`: None when a needle fits neither side."""
    room = [before, after]
    sides = []
    for n in lengths:
        fits = [s for s in (0, 1) if room[s] >= n]
        if not fits:
            return None
        s = fits[0] if len(fits) == 1 else (0 if rng.random() * (room[0] + room[1]) < room[0] else 1)
        room[s] -= n
        sides.append(s == 0)
    return sides


def _interleave(rng: random.Random, units: list, items: list) -> list[tuple[str, Any]]:
    """`units` with each of `items` inserted at a random boundary between units, keeping both orders;
    returns a list of ("unit", unit) and ("item", item) entries."""
    slots = sorted(rng.randint(0, len(units)) for _ in items)
    out, k = [], 0
    for i in range(len(units) + 1):
        while k < len(slots) and slots[k] == i:
            out.append(("item", items[k]))
            k += 1
        if i < len(units):
            out.append(("unit", units[i]))
    return out


# A haystack unit: ("tokens", ids) for text or padding, or ("filler", Needle fields without the spans, tokens).
_Unit = tuple


def _filler_units(rng, tokenizer, budget: int, digits: int, numbers: set[str], used: set[str]) -> list[_Unit]:
    """Whole filler needles plus single PAD tokens that fill exactly `budget` tokens, with cities not
    in `used` (added to it) and numbers not in `numbers`."""
    pad = template_ids(tokenizer, PAD)
    if len(pad) != 1:
        raise ValueError(f"the tokenizer encodes {PAD!r} as {len(pad)} tokens; needles-only haystacks pad with one")

    def make(city: str, number: str):
        made = needle_tokens(tokenizer, city, number)
        return made, len(made[0])

    fillers, left = draw_fillers(rng, budget, digits, numbers, used, make)
    units: list[_Unit] = [("filler", city, number, made) for city, number, made in fillers]
    for _ in range(left):
        units.insert(rng.randint(0, len(units)), ("tokens", pad))
    return units


# ------------------------------------------------------------------------------------------- prompt


def needle_prompt(tokenizer, rng: random.Random, *, length: int, depth: float, needles: int = 1, queries: int = 1,
                  haystack: str = "text", text: HeldoutText | None = None, digits: int = 7,
                  context: int | None = None) -> NeedleSample:
    """One retrieval prompt of exactly `length` tokens (see the module doc); `rng` decides everything.

    `text`: the held-out tokens for haystack "text". `context`: the model's context; a longer
    `length` is refused. Bad values are a one-line ValueError."""
    check_needle_args(length=length, depth=depth, needles=needles, queries=queries, haystack=haystack,
                      digits=digits, context=context)
    check_pieces(tokenizer)
    if haystack == "text" and text is None:
        raise ValueError("haystack 'text' needs held-out tokens (HeldoutText of a held-out split, e.g. "
                         "eval.tasks.needle.haystack_text); pass text=... or use haystack 'needles'")
    shortest = min_prompt_length(tokenizer, needles, queries, digits)
    if length < shortest:
        fewer = " or fewer needles" if needles > 1 else ""
        raise ValueError(f"{needles} needle(s) with the instruction and question do not fit in a {length}-token prompt "
                         f"(the shortest possible is {shortest}); use a length of at least {shortest} tokens{fewer}")
    reason = ""
    for _ in range(50):
        try:
            return _build(tokenizer, rng, length, float(depth), needles, queries, haystack, text, digits)
        except _Redraw as e:
            reason = str(e)
    raise ValueError(reason)


class _Redraw(Exception):
    """This draw of cities and numbers cannot make the prompt; another draw may (the message says why not)."""


def check_needle_args(*, length: int, depth: float, needles: int, queries: int, haystack: str, digits: int,
                      context: int | None) -> None:
    """The one-line ValueErrors for values that cannot make a prompt."""
    if context is not None and length > context:
        raise ValueError(f"needle prompt length {length} is beyond the model's context of {context} tokens; "
                         f"use a length <= {context}")
    if length <= 0:
        raise ValueError(f"needle prompt length must be positive, got {length}")
    if not 0 <= depth <= 100:
        raise ValueError(f"needle depth {depth} is outside 0..100 (percent of the context); "
                         f"use e.g. 0, 25, 50, 75, 100")
    if needles < 1:
        raise ValueError(f"needles must be >= 1, got {needles}")
    if not 1 <= queries <= needles:
        raise ValueError(f"queries (R={queries}) must be between 1 and the number of needles (N={needles}): "
                         f"only needles in the prompt can be asked for")
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {', '.join(HAYSTACKS)}, got {haystack!r}")
    if not 1 <= digits <= 18:
        raise ValueError(f"digits must be between 1 and 18, got {digits}")
    if 9 * 10 ** (digits - 1) < needles:
        raise ValueError(f"{needles} distinct numbers of {digits} digits do not exist; use more digits")


@dataclass
class _Draw:
    """One draw's cities and numbers; needle i is cities[i] with nums[i], needle 0 the answer."""

    cities: list[str]
    nums: list[str]
    numbers: set[str]  # every number drawn so far (fillers draw around them)
    queried: list[str]  # queried[0] is cities[0]
    made: list[tuple[list[int], int, int]]  # needle_tokens of each needle


@dataclass
class _Plan:
    """Where the draw's needles go: the answer at context offset `a`, the others by side (True = before)."""

    a: int
    side_needles: dict[bool, list[int]]
    budget: dict[bool, int]  # haystack tokens per side


def _draw(tokenizer, rng, n_needles: int, n_queries: int, digits: int) -> tuple[_Draw, list[str]]:
    """The draw, and the queried cities in the order the R > 1 question shows them."""
    drawn = draw_needles(rng, n_needles, digits, size=lambda number: len(number_ids(tokenizer, number)))
    if drawn is None:
        raise _Redraw(f"could not draw {n_needles} {digits}-digit numbers of one token count (forced choice compares "
                      f"equally long candidates); use more digits or fewer needles")
    cities, nums, numbers = drawn
    queried = [cities[0]] + rng.sample(cities[1:], n_queries - 1)
    shown = list(queried)
    rng.shuffle(shown)
    made = [needle_tokens(tokenizer, c, x) for c, x in zip(cities, nums)]
    return _Draw(cities, nums, numbers, queried, made), shown


def _question(tokenizer, queried: list[str], shown: list[str]) -> tuple[list[int], list[list[int]]]:
    """(the question of queried[0]'s prompt, each queried city's question through its cue)."""
    if len(queried) == 1:
        question = template_ids(tokenizer, question_text(queried))
        return question, [question]
    head = tokenizer.encode(question_text(shown))
    cues = [head + template_ids(tokenizer, CUE.format(city=c)) for c in queried]
    return cues[0], cues


def _plan(rng, draw: _Draw, length: int, C: int, depth: float) -> _Plan:
    """Place the answer at its exact depth in the C context tokens and split the others around it."""
    n_needles = len(draw.cities)
    total = sum(len(m[0]) for m in draw.made)
    if C < total:
        raise _Redraw(f"{n_needles} needles with the instruction and question rarely fit in a {length}-token prompt "
                      f"(the last draw needed {length + total - C}); use a longer length or fewer needles")
    answer_len = len(draw.made[0][0])
    a = round(depth / 100 * (C - answer_len))
    before_room, after_room = a, C - a - answer_len
    others = list(range(1, n_needles))
    rng.shuffle(others)
    sides = _assign_sides(rng, [len(draw.made[i][0]) for i in others], before_room, after_room)
    if sides is None:
        raise _Redraw(f"the {n_needles - 1} other needles do not fit around the answer at depth {depth:g} in a "
                      f"{length}-token prompt (an exact depth needs about one needle's length of haystack); use a "
                      f"longer length or fewer needles")
    side_needles = {True: [i for i, s in zip(others, sides) if s], False: [i for i, s in zip(others, sides) if not s]}
    budget = {s: (before_room if s else after_room) - sum(len(draw.made[i][0]) for i in side_needles[s])
              for s in (True, False)}
    return _Plan(a, side_needles, budget)


def _haystack(rng, tokenizer, draw: _Draw, plan: _Plan, haystack: str, text: HeldoutText | None,
              digits: int) -> tuple[int | None, dict[bool, list[_Unit]]]:
    """(where the text window starts, or None; each side's haystack units)."""
    if haystack == "text":
        offset, window = text.window(rng, plan.budget[True] + plan.budget[False])
        cut = plan.budget[True]
        return offset, {True: [("tokens", [t]) for t in window[:cut]],
                        False: [("tokens", [t]) for t in window[cut:]]}
    used = set(draw.cities)
    return None, {s: _filler_units(rng, tokenizer, plan.budget[s], digits, draw.numbers, used) for s in (True, False)}


class _Prompt:
    """The prompt's tokens as they are laid down, and every needle placed (with its spans)."""

    def __init__(self, eos_id: int, instruction: list[int]):
        self.ids = [eos_id, *instruction]
        self.context_start = len(self.ids)  # after BOS and the instruction
        self.placed: list[Needle] = []

    def put(self, city: str, number: str, made: tuple[list[int], int, int], filler: bool) -> None:
        toks, na, nb = made
        start = len(self.ids)
        self.ids.extend(toks)
        self.placed.append(Needle(city, number, (start, start + len(toks)), (start + na, start + nb), filler))

    def side(self, rng, draw: _Draw, units: list[_Unit], needles: list[int]) -> None:
        """One side of the answer: its haystack units with its needles at random boundaries."""
        for kind, entry in _interleave(rng, units, needles):
            if kind == "item":
                self.put(draw.cities[entry], draw.nums[entry], draw.made[entry], False)
            elif entry[0] == "filler":
                self.put(entry[1], entry[2], entry[3], True)
            else:
                self.ids.extend(entry[1])


def _build(tokenizer, rng, length, depth, n_needles, n_queries, haystack, text, digits) -> NeedleSample:
    """One draw; _Redraw when its cities or numbers cannot make the prompt (the caller draws again)."""
    draw, shown = _draw(tokenizer, rng, n_needles, n_queries, digits)
    question, cues = _question(tokenizer, draw.queried, shown)
    instruction = template_ids(tokenizer, INSTRUCTION)
    plan = _plan(rng, draw, length, length - 1 - len(instruction) - len(question), depth)
    offset, units = _haystack(rng, tokenizer, draw, plan, haystack, text, digits)
    prompt = _Prompt(tokenizer.eos_id, instruction)
    prompt.side(rng, draw, units[True], plan.side_needles[True])
    answer_start = len(prompt.ids)
    prompt.put(draw.cities[0], draw.nums[0], draw.made[0], False)
    prompt.side(rng, draw, units[False], plan.side_needles[False])
    query_start = len(prompt.ids)
    assert query_start + len(question) == length and answer_start == 1 + len(instruction) + plan.a, \
        "needle layout arithmetic"
    return _sample(tokenizer, prompt, draw, cues, answer_start, query_start, depth, length, haystack, offset, digits)


def _sample(tokenizer, prompt: _Prompt, draw: _Draw, cues: list[list[int]], answer_start: int, query_start: int,
            depth: float, length: int, haystack: str, offset: int | None, digits: int) -> NeedleSample:
    """The NeedleSample of a laid-out prompt; _Redraw when a number occurs more than once in its text."""
    ids = prompt.ids + cues[0]
    decoded = tokenizer.decode(ids)
    if any(decoded.count(n.number) != 1 for n in prompt.placed):
        raise _Redraw(f"could not draw {digits}-digit numbers that each occur once in a {length}-token prompt; "
                      f"use more digits")
    answer = next(n for n in prompt.placed if n.span[0] == answer_start)
    segments = Segments(bos=(0, 1), before=(1, answer_start), answer=answer.span, number=answer.number_span,
                        after=(answer.span[1], query_start), query=(query_start, length))
    number_of = {n.city: n.number for n in prompt.placed}
    real = [n for n in prompt.placed if not n.filler]
    return NeedleSample(
        ids=tuple(ids), prompts=tuple(tuple(prompt.ids + cue) for cue in cues), queried=tuple(draw.queried),
        targets=tuple(number_of[c] for c in draw.queried), needles=tuple(prompt.placed),
        candidate_ids=tuple(tuple(number_ids(tokenizer, n.number)) for n in real), segments=segments,
        depth=depth, length=length, haystack=haystack, source_offset=offset, context_start=prompt.context_start)


# ---------------------------------------------------------------------------------- training documents


class TextSource(Protocol):
    """Where a training document's haystack comes from (data/mixture.TrainText): EOS-free token windows."""

    def window(self, rng: random.Random, n: int) -> tuple[int, Any]: ...


def needle_document(rng: random.Random, tok, text: TextSource, length: int, max_needles: int) -> str:
    """[instruction][train haystack with k needles][question][answers], about `length` tokens with its EOS."""
    n = lambda s: len(tok.encode(s))  # noqa: E731
    top = max_needles
    for _ in range(DOCUMENT_ATTEMPTS):
        k = rng.randint(1, top)
        cities, nums, _ = draw_needles(rng, k, DOCUMENT_DIGITS)
        numbers = dict(zip(cities, nums))
        queried = rng.sample(cities, rng.randint(1, min(k, MAX_QUERIES)))
        tail = answered_question(queried, numbers, rng)
        sentences = [needle_sentence(c, numbers[c]) for c in cities]
        budget = length - 1 - n(INSTRUCTION) - n(tail) - sum(n(s) for s in sentences)
        if budget < 0:
            if k == 1:
                raise ValueError(f"data.mixture.length = {length} tokens cannot hold the instruction, one needle and "
                                 f"its question (they take {length - budget}); raise data.mixture.length")
            top = k - 1
            continue
        doc = _with_haystack(rng, tok, text, budget, sentences) + tail
        if all(doc.count(x) == 1 + (c in queried) for c, x in numbers.items()):
            return doc
    raise ValueError(f"could not draw {DOCUMENT_DIGITS}-digit needle numbers that occur only where placed in "
                     f"{DOCUMENT_ATTEMPTS} tries; the train text is full of such numbers")


def _with_haystack(rng: random.Random, tok, text: TextSource, budget: int, sentences: list[str]) -> str:
    """The instruction, then a `budget`-token window of `text` cut between any two tokens by `sentences`."""
    _, window = text.window(rng, budget)
    cuts = sorted(rng.randint(0, budget) for _ in sentences)
    pieces, prev = [INSTRUCTION], 0
    for cut, sentence in zip(cuts, sentences):
        pieces += [tok.decode(window[prev:cut].tolist()), sentence]
        prev = cut
    return "".join([*pieces, tok.decode(window[prev:].tolist())])


def needles_only_document(rng: random.Random, tok, length: int) -> str:
    """[instruction][whole needles only][question][answers], about `length` tokens with its EOS."""
    n = lambda s: len(tok.encode(s))  # noqa: E731
    queried, nums, taken = draw_needles(rng, rng.randint(1, MAX_QUERIES), DOCUMENT_DIGITS)
    numbers = dict(zip(queried, nums))
    tail = answered_question(queried, numbers, rng)
    sentences = [needle_sentence(c, numbers[c]) for c in queried]
    left = length - 1 - n(INSTRUCTION) - n(tail) - sum(n(s) for s in sentences)
    if left < 0:
        raise ValueError(f"data.mixture.length = {length} tokens cannot hold a needles-only document's instruction, "
                         f"needles and question (they take {length - left}); raise data.mixture.length")

    def make(city: str, number: str):
        sentence = needle_sentence(city, number)
        return sentence, n(sentence)

    fillers, _ = draw_fillers(rng, left, DOCUMENT_DIGITS, taken, set(queried), make)
    sentences += [sentence for _, _, sentence in fillers]
    rng.shuffle(sentences)
    return INSTRUCTION + "".join(sentences) + tail
