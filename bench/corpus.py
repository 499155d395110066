"""A generated corpus with known answers, for the collections bench and tests.

Each document is a report of several sections ("pages") of filler prose drawn from a
Zipf-distributed vocabulary of made-up words, with one fact in it: "The <attribute>
of <entity> is <value>." Entities are two words of a mid-frequency pool, so a
question ("what is the <attribute> of <entity>?") shares words with many documents
and only one answers it: the ranking has to weigh rare words over common ones.
Everything is seeded: the same arguments give the same corpus.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYLLABLES = (
    "ka lo mi ter van dor sel qui bra nu pe zor fi gal ment ost ri ha cen tul mo jad vex"
).split()
COMMON = (
    "the of and to in a is that for it as was with be by on not he this are or his from"
    " at which but have an they you were their one all we can her has there been if more"
    " when will would who so no"
).split()
ATTRIBUTES = (
    "budget",
    "deadline",
    "owner",
    "location",
    "capacity",
    "supplier",
    "codename",
    "version",
)


@dataclass(frozen=True, slots=True)
class Document:
    number: int
    title: str  # a path, as a document of a zipped folder tree is titled
    pages: list[str]
    attribute: str
    entity: str
    value: str

    @property
    def text(self) -> str:
        return "\n\n".join(self.pages)


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    answer: int  # the number of the document that answers it


def _words(rng: random.Random, count: int, low: int, high: int) -> list[str]:
    out: set[str] = set()
    while len(out) < count:
        out.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(low, high))))
    return sorted(out)


def generate(
    count: int, *, pages: int = 3, words_per_page: int = 250, seed: int = 7
) -> tuple[list[Document], list[Question]]:
    """`count` documents of `pages` pages, and one question per document."""
    rng = random.Random(seed)
    vocabulary = _words(rng, 20_000, 2, 4)
    rng.shuffle(vocabulary)
    weights = [1.0 / (rank + 1) ** 1.05 for rank in range(len(vocabulary))]
    pool = vocabulary[2_000:6_000]  # mid-frequency words make entities
    values = _words(random.Random(seed + 1), count, 4, 5)
    documents, questions = [], []
    for n in range(count):
        attribute = ATTRIBUTES[n % len(ATTRIBUTES)]
        entity = " ".join(rng.sample(pool, 2))
        value = values[n]
        body = []
        fact_page = rng.randrange(pages)
        for p in range(pages):
            filler = rng.choices(vocabulary, weights, k=words_per_page)
            for i in range(0, len(filler), 12):
                filler.insert(i, rng.choice(COMMON))
            sentences = [
                " ".join(filler[i : i + 14]).capitalize() + "." for i in range(0, len(filler), 14)
            ]
            if p == fact_page:
                at = rng.randrange(len(sentences) + 1)
                sentences.insert(at, f"The {attribute} of {entity} is {value}.")
            body.append(" ".join(sentences))
        folder = f"unit-{n % 7}/team-{n % 5}"
        documents.append(Document(n, f"{folder}/report-{n:05d}.md", body, attribute, entity, value))
        questions.append(Question(f"what is the {attribute} of {entity}?", n))
    return documents, questions


def with_distractors(
    documents: list[Document], questions: list[Question], *, seed: int = 13
) -> list[Document]:
    """Documents that nearly answer each of `questions`, to add to the corpus: for the
    fact "the <attribute> of <w1 w2> is <value>", one with the same entity and another
    attribute, and two with the same attribute and one of the entity's words (each
    naming its near-entity twice), in prose of their own. Only the answer has every
    word of the question, but the distractors have most of them, often more often:
    ranking them apart is up to term weighting and length normalisation, which a
    sloppy BM25 gets wrong."""
    rng = random.Random(seed)
    pool = sorted({w for d in documents for w in d.entity.split()})
    values = _words(random.Random(seed + 1), 4 * len(questions) + 8, 4, 5)
    # their prose is new (a corpus of its own): a copy of another report's pages would
    # tie with it on every word, and ties, not weighting, would then decide the order
    words = max(1, len(documents[0].pages[0].split()) * 12 // 13)
    filler, _ = generate(
        3 * len(questions), pages=len(documents[0].pages), words_per_page=words, seed=seed + 2
    )
    extra: list[Document] = []
    number = max(d.number for d in documents) + 1
    for q in questions:
        answer = documents[q.answer]
        first, second = answer.entity.split()
        others = [a for a in ATTRIBUTES if a != answer.attribute]
        facts = [
            (rng.choice(others), answer.entity),
            (answer.attribute, f"{first} {rng.choice(pool)}"),
            (answer.attribute, f"{rng.choice(pool)} {second}"),
        ]
        for attribute, entity in facts:
            base = filler[len(extra)]
            value = values[len(extra) % len(values)]
            said = f"The {attribute} of {entity} is {value}. Ask {entity} about it."
            pages = [said + " " + base.pages[0], *base.pages[1:]]
            title = f"distractors/report-{number:05d}.md"
            extra.append(Document(number, title, pages, attribute, entity, value))
            number += 1
    return extra
