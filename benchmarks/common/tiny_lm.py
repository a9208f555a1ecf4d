"""A small byte-level transformer language model and a deterministic local corpus, for the benchmarks.

The corpus is the source text of a fixed list of Python standard-library modules, read from this interpreter's
``stdlib`` directory (no download). Each file is split once: its first 90 % goes to training, its last 10 % to the
held-out set, so both sides see every module's style. Text is read as bytes (vocabulary 256) and cut into
non-overlapping windows of ``CONTEXT + 1`` bytes: a window's first ``CONTEXT`` bytes are the input, its last
``CONTEXT`` bytes the targets.

The corpus depends on the Python version's standard library; :func:`corpus_digest` goes into every result file so
that numbers from different interpreters are not compared by mistake.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

CONTEXT = 64
VOCAB = 256
HELD_OUT_FRACTION = 0.1

# Fixed and ordered: the corpus is the concatenation of these files, in this order.
CORPUS_MODULES: tuple[str, ...] = (
    "argparse",
    "collections/__init__",
    "dataclasses",
    "functools",
    "inspect",
    "json/decoder",
    "json/encoder",
    "logging/__init__",
    "pathlib",
    "shutil",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "zipfile",
    "email/message",
    "http/client",
    "urllib/parse",
    "unittest/case",
)


def corpus_files(stdlib: str | None = None) -> list[Path]:
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = [root / f"{name}.py" for name in CORPUS_MODULES]
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"corpus files missing from the standard library: {', '.join(missing)}")
    return files


def split_corpus(texts: list[bytes], held_out_fraction: float = HELD_OUT_FRACTION) -> tuple[bytes, bytes]:
    """(train, held-out): the first ``1 - held_out_fraction`` of every text trains, the rest is held out."""
    train, held_out = [], []
    for text in texts:
        cut = int(len(text) * (1.0 - held_out_fraction))
        train.append(text[:cut])
        held_out.append(text[cut:])
    return b"".join(train), b"".join(held_out)


def load_corpus(stdlib: str | None = None) -> tuple[bytes, bytes]:
    return split_corpus([path.read_bytes() for path in corpus_files(stdlib)])


def corpus_digest(stdlib: str | None = None) -> str:
    digest = hashlib.sha256()
    for path in corpus_files(stdlib):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class Windows(Dataset):
    """Non-overlapping windows of ``context + 1`` bytes: ``(input, target)``, the target shifted by one."""

    def __init__(self, text: bytes, context: int = CONTEXT) -> None:
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.context = context
        self.count = (len(text) - 1) // context

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.context
        chunk = self.data[start : start + self.context + 1].long()
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(pl.LightningModule):
    """A GPT-style byte-level LM: learned positions, pre-LayerNorm blocks, an untied output head (tied weights
    would have to sit in one streaming-DiLoCo fragment). No dropout, so training is deterministic given the data."""

    def __init__(
        self,
        d_model: int = 128,
        layers: int = 2,
        heads: int = 4,
        context: int = CONTEXT,
        lr: float = 2e-3,
        warmup_steps: int = 20,
        min_lr_fraction: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, targets = batch
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> dict:
        """AdamW, linear warmup then cosine decay to ``min_lr_fraction`` over ``max_steps`` inner steps."""
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = max(int(self.trainer.max_steps), 1)
        warmup, floor = self.hparams.warmup_steps, self.hparams.min_lr_fraction

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def held_out_loss(model: TinyLM, held_out: bytes, batch_size: int = 256) -> float:
    """Mean cross-entropy in nats per byte over every window of the held-out text (the same set for every run)."""
    model.eval()
    loader = DataLoader(Windows(held_out, model.hparams.context), batch_size=batch_size, shuffle=False)
    total, count = 0.0, 0
    for tokens, targets in loader:
        logits = model(tokens)
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
    return total / count
