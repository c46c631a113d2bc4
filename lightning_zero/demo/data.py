"""Data for the demo GPT, generated at runtime so nothing is ever downloaded.

``CharDataModule`` produces a character-level corpus from a tiny probabilistic
grammar ("The old farmer sees a red bird near the river."). The text has real,
quickly learnable structure at several scales -- spelling inside words, word
order, a/an agreement, capitalisation after a full stop, question syntax -- so a
tiny model's loss drops well below the uniform ``ln(vocab_size)`` within ~100
steps, which makes it a good smoke test that a distributed strategy still trains.

``RandomTokenDataModule`` serves uniformly random tokens: nothing to learn, only
useful where throughput and memory are measured.
"""

from __future__ import annotations

import random
from typing import Sequence, TypeVar, cast

import lightning as L
import torch
from lightning.pytorch.utilities import AttributeDict
from torch.utils.data import DataLoader, Dataset

# --------------------------------------------------------------------------- grammar

DETERMINERS = ("the", "a", "every", "my", "this", "one")
ADJECTIVES = ("small", "big", "red", "old", "quiet", "happy", "dark", "green", "tired", "clever")
NOUNS = ("cat", "dog", "bird", "child", "farmer", "river", "house", "king", "tree", "ship", "apple", "owl")
# transitive verbs as (third person singular, base form): questions need the base form
TRANSITIVE = (
    ("sees", "see"),
    ("likes", "like"),
    ("finds", "find"),
    ("follows", "follow"),
    ("builds", "build"),
    ("carries", "carry"),
    ("watches", "watch"),
    ("helps", "help"),
)
INTRANSITIVE = (
    ("sleeps", "sleep"),
    ("runs", "run"),
    ("sings", "sing"),
    ("waits", "wait"),
    ("falls", "fall"),
    ("laughs", "laugh"),
)
ADVERBS = ("slowly", "today", "again", "quietly", "at night", "every day")
PREPOSITIONS = ("near", "under", "behind", "with", "over")
CONJUNCTIONS = ("and", "but", "so")
PUNCTUATION = " .,?\n"

_Option = TypeVar("_Option")


def _all_words() -> list[str]:
    verbs = [w for pair in TRANSITIVE + INTRANSITIVE for w in pair]
    return [*DETERMINERS, "an", "does", *ADJECTIVES, *NOUNS, *verbs, *ADVERBS, *PREPOSITIONS, *CONJUNCTIONS]


def grammar_alphabet() -> list[str]:
    """Every character the generator can emit, sorted: a fixed, corpus-independent vocabulary."""
    chars = set("".join(_all_words())) | set(PUNCTUATION)
    # Only sentence-initial words are ever capitalised: a determiner, "an" or "does".
    chars |= {w[0].upper() for w in (*DETERMINERS, "an", "does")}
    return sorted(chars)


class GrammarGenerator:
    """Samples sentences from the grammar with its own seeded RNG (never the global one)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def _pick(self, options: Sequence[_Option]) -> _Option:
        return options[self.rng.randrange(len(options))]

    def noun_phrase(self, allow_pp: bool = True) -> str:
        words = [self._pick(DETERMINERS)]
        if self.rng.random() < 0.5:
            words.append(self._pick(ADJECTIVES))
        words.append(self._pick(NOUNS))
        if words[0] == "a" and words[1][0] in "aeiou":
            words[0] = "an"  # a/an agreement: a cheap, learnable long-ish dependency
        if allow_pp and self.rng.random() < 0.25:
            words += [self._pick(PREPOSITIONS), self.noun_phrase(allow_pp=False)]
        return " ".join(words)

    def clause(self) -> str:
        subject = self.noun_phrase()
        if self.rng.random() < 0.6:
            verb = self._pick(TRANSITIVE)[0]
            return f"{subject} {verb} {self.noun_phrase()}"
        verb = self._pick(INTRANSITIVE)[0]
        if self.rng.random() < 0.5:
            return f"{subject} {verb} {self._pick(ADVERBS)}"
        return f"{subject} {verb}"

    def sentence(self) -> str:
        r = self.rng.random()
        if r < 0.15:  # question: "does NP <base verb> NP?"
            verb = self._pick(TRANSITIVE)[1]
            text = f"does {self.noun_phrase()} {verb} {self.noun_phrase()}?"
        elif r < 0.35:  # compound: "S, and S."
            text = f"{self.clause()}, {self._pick(CONJUNCTIONS)} {self.clause()}."
        else:
            text = f"{self.clause()}."
        return text[0].upper() + text[1:]

    def text(self, num_chars: int) -> str:
        """At least ``num_chars`` characters of sentences, 1-4 per line, truncated exactly."""
        lines: list[str] = []
        total = 0
        while total < num_chars:
            line = " ".join(self.sentence() for _ in range(self.rng.randint(1, 4))) + "\n"
            lines.append(line)
            total += len(line)
        return "".join(lines)[:num_chars]


# --------------------------------------------------------------------------- datasets


class TokenWindowDataset(Dataset):
    """Next-token pairs from a 1-D token stream.

    Item ``i`` is ``(data[s : s+T], data[s+1 : s+T+1])`` with ``s = i * stride``, both
    LongTensors of shape ``(block_size,)``. Stride 1 (every offset) for training gives
    plenty of distinct samples; stride ``block_size`` keeps validation small.
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int = 1) -> None:
        if data.dim() != 1 or data.numel() <= block_size:
            raise ValueError(f"need a 1-D stream longer than block_size={block_size}, got {tuple(data.shape)}")
        self.data = data
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (self.data.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.stride
        chunk = self.data[s : s + self.block_size + 1]  # (T+1,)
        return chunk[:-1], chunk[1:]  # (T,), (T,)


class RandomTokenDataset(Dataset):
    """``num_samples`` fixed rows of uniform random tokens (pre-generated, so cheap to index)."""

    def __init__(self, num_samples: int, block_size: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, vocab_size, (num_samples, block_size + 1), generator=g)  # (N, T+1)

    def __len__(self) -> int:
        return self.rows.size(0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[i]  # (T+1,)
        return row[:-1], row[1:]  # (T,), (T,)


# --------------------------------------------------------------------------- datamodules


class CharDataModule(L.LightningDataModule):
    """Character-level LM data over a deterministic synthetic corpus.

    Args:
        block_size: context length T of each sample.
        batch_size: per-rank batch size.
        num_tokens: corpus length in characters (= tokens).
        seed: seeds the corpus generator only; the same seed gives the same text on every rank.
        val_fraction: tail fraction of the corpus held out for validation.
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 16,
        num_tokens: int = 200_000,
        seed: int = 1234,
        val_fraction: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.itos = grammar_alphabet()
        self.stoi = {c: i for i, c in enumerate(self.itos)}
        self.train_set: TokenWindowDataset | None = None
        self.val_set: TokenWindowDataset | None = None

    @property
    def vocab_size(self) -> int:
        """Known before ``setup()``: it comes from the grammar, not from the generated text."""
        return len(self.itos)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return "".join(self.itos[int(i)] for i in ids)

    def corpus(self) -> str:
        hp = cast(AttributeDict, self.hparams)
        return GrammarGenerator(hp.seed).text(hp.num_tokens)

    def setup(self, stage: str | None = None) -> None:
        # Cheap and deterministic, so every rank simply builds its own copy; no prepare_data()/filesystem
        # handshake needed.
        if self.train_set is not None:
            return
        data = self.encode(self.corpus())  # (num_tokens,)
        hp = cast(AttributeDict, self.hparams)
        T = hp.block_size
        n_val = max(int(data.numel() * hp.val_fraction), T + 2)
        self.train_set = TokenWindowDataset(data[:-n_val], T, stride=1)
        self.val_set = TokenWindowDataset(data[-n_val:], T, stride=T)

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not run yet; pass the datamodule to a Trainer.")
        batch_size = cast(AttributeDict, self.hparams).batch_size
        # drop_last keeps every step's batch shape identical on every rank.
        return DataLoader(self.train_set, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        if self.val_set is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not run yet; pass the datamodule to a Trainer.")
        batch_size = cast(AttributeDict, self.hparams).batch_size
        return DataLoader(self.val_set, batch_size=batch_size, shuffle=False, num_workers=0)

    # The held-out text serves `test` and `predict` too: the corpus is synthetic, so there is no
    # separate test distribution to keep apart.
    test_dataloader = val_dataloader
    predict_dataloader = val_dataloader


class RandomTokenDataModule(L.LightningDataModule):
    """Uniform random tokens with a fixed vocabulary: for benchmarks, where only speed matters.

    Only a train dataloader is provided, so no validation loop runs.
    """

    def __init__(
        self,
        vocab_size: int = 8192,
        block_size: int = 128,
        batch_size: int = 8,
        num_samples: int = 2048,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.vocab_size = vocab_size
        self.train_set: RandomTokenDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            hp = cast(AttributeDict, self.hparams)
            self.train_set = RandomTokenDataset(hp.num_samples, hp.block_size, hp.vocab_size, hp.seed)

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not run yet; pass the datamodule to a Trainer.")
        batch_size = cast(AttributeDict, self.hparams).batch_size
        return DataLoader(self.train_set, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=0)
