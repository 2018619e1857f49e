"""Tokenizers and the families' prompt formats.

Which tokenizer:

- `ByteTokenizer`: one token per UTF-8 byte after BOS, no files. For models trained from scratch
  (the tiny presets, the demo).
- `SentencePieceTokenizer`: PaliGemma's SentencePiece model (pi0 / pi0.5), from a local
  ``*.model`` file.
- `QwenTokenizer`: Qwen3's byte-level BPE (GR00T N1.5's Eagle backbone), from a ``tokenizer.json``
  or from the ``vocab.json`` + ``merges.txt`` (+ added tokens) that Isaac-GR00T ships.
- `SmolVLM2Tokenizer`: SmolVLM2's GPT-2-style BPE (SmolVLA; vocab 49280), from the ``tokenizer.json`` of
  ``HuggingFaceTB/SmolVLM2-500M-Video-Instruct`` (or a folder holding it), read with `tokenizers`.

Nothing is ever downloaded: `find_tokenizer` looks at ``--policy.tokenizer`` first, then next to the
checkpoint a run starts from, and says what it looked for when nothing is there.

Prompt formats, exactly as the families build them:

- pi0 (openpi): BOS + the cleaned task, then a separately encoded "\\n" (the start-of-answer token).
- pi0.5 with state (openpi): BOS + "Task: {task}, State: {bins};\\nAction: ", the state normalised to
  [-1, 1] and cut into 256 bins: ``[-1.0, 0.0, 1.0] -> "0 128 255"``.
- GR00T N1.5 (Eagle 2.5 chat template, Qwen3 tokens, no BOS)::

      <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n
      <image 1><img>{<IMG_CONTEXT> x 256}</img><image 2><img>...</img>{task}<|im_end|>\\n<|im_start|>assistant\\n

  (one line here; no line breaks in between). The model puts each camera's features where its
  ``<IMG_CONTEXT>`` run is (`GrootConfig.image_token_id`).
- GR00T N1.7 (Isaac-GR00T's `Gr00tN1d7Processor`, Qwen3-VL's processor): the task formalised (lower case,
  punctuation removed), then the conversation ``[{"role": "user", "content": [image x cameras, task]}]``
  rendered by the chat template kept beside the tokenizer (`ChatTemplate`; no generation prompt), each
  ``<|image_pad|>`` it writes grown to the image's tokens. Qwen3-VL's own template gives::

      <|im_start|>user\n<|vision_start|>{<|image_pad|> x P}<|vision_end|>...{task}<|im_end|>\n

- SmolVLA (LeRobot's processor: `SmolVLANewLineProcessor`, then `TokenizerProcessorStep`): the task as
  given (not cleaned), "\\n" appended unless it ends with one, encoded with the tokenizer's own special
  tokens (its tokenizer.json post-processor, as transformers' ``add_special_tokens=True``: no BOS unless
  the file adds one), cut at the end to ``tokenizer_max_length`` (48) as the tokenizer truncates, right
  padded (to 48 with ``language_padding="max_length"``, ``lerobot/smolvla_base``'s ``pad_language_to``)::

      "pick up the cube" -> encode("pick up the cube\\n") -> ids[:48], then padding to 48

Prompts longer than the model's language budget are cut at the end, as openpi does, with one warning
per process that gives the counts.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from kilovla.errors import KilovlaError

log = logging.getLogger(__name__)

PAD, BOS = 0, 1
BYTE_VOCAB_SIZE = 258  # pad, bos, 256 bytes
TOKENIZER_KINDS = ("byte", "paligemma", "qwen3", "smolvlm2")


class Tokenizer(Protocol):
    kind: str
    vocab_size: int

    def encode(self, text: str, bos: bool = True) -> list[int]: ...


class ByteTokenizer:
    kind = "byte"
    vocab_size = BYTE_VOCAB_SIZE
    path = None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([BOS] if bos else []) + [b + 2 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 2 for i in ids if i >= 2).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """PaliGemma's tokenizer (Gemma's 257152-token SentencePiece model): ``paligemma_tokenizer.model``."""

    kind = "paligemma"

    def __init__(self, path: str | Path):
        try:
            import sentencepiece
        except ImportError:
            raise KilovlaError("a SentencePiece tokenizer needs `pip install sentencepiece`") from None
        self.path = Path(path)
        if not self.path.is_file():
            raise KilovlaError(f"{path}: tokenizer model not found")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as e:
            raise KilovlaError(f"{path}: not a SentencePiece model: {e}") from None
        self.vocab_size = self._sp.vocab_size()

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self._sp.encode(text, add_bos=bos)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(ids)


# transformers' Qwen2 conversion of vocab.json + merges.txt into a fast tokenizer.
_QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")


class QwenTokenizer:
    """Qwen3's byte-level BPE with its added tokens (``<|im_start|>``, ``<IMG_CONTEXT>``, ...).

    `path`: a ``tokenizer.json``, or a folder holding one, or a folder with ``vocab.json`` +
    ``merges.txt`` and the added tokens in ``tokenizer_config.json`` / ``added_tokens.json``
    (Isaac-GR00T's ``gr00t/model/backbone/eagle2_hg_model``). Qwen adds no BOS.
    """

    kind = "qwen3"
    title = "a Qwen"

    def __init__(self, path: str | Path):
        try:
            import tokenizers
        except ImportError:
            raise KilovlaError(f"{self.title} tokenizer needs `pip install tokenizers`") from None
        path = Path(path)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        self.path = path
        try:
            if path.is_file():
                self._tok = tokenizers.Tokenizer.from_file(str(path))
            elif path.is_dir() and (path / "vocab.json").is_file() and (path / "merges.txt").is_file():
                self._tok = _qwen_from_vocab_merges(path)
            else:
                raise KilovlaError(f"{path}: no tokenizer.json, nor vocab.json + merges.txt")
        except KilovlaError:
            raise
        except Exception as e:  # tokenizers reports a malformed file as a plain Exception
            raise KilovlaError(f"{path}: not {self.title} tokenizer: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.folder = path if path.is_dir() else path.parent  # where its chat template would be

    @functools.cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The chat template beside the tokenizer, read and compiled once (`load_chat_template`); None: none."""
        return load_chat_template(self.folder)

    def has_token(self, token: str) -> bool:
        return self._tok.token_to_id(token) is not None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KilovlaError(f"{self.path}: the tokenizer has no {token!r} token (another model's tokenizer?)")
        return i


class SmolVLM2Tokenizer(QwenTokenizer):
    """SmolVLM2's tokenizer (SmolVLA's VLM): `path` a ``tokenizer.json`` or a folder holding one. `encode`
    adds what the file's post-processor adds (`bos`: transformers' ``add_special_tokens``)."""

    kind = "smolvlm2"
    title = "a SmolVLM2"

    def __init__(self, path: str | Path):
        super().__init__(path)
        self._cut: dict = {}  # max_length -> a copy that truncates as transformers' `truncation=True` does

    def encode(self, text: str, bos: bool = True, max_length: int | None = None) -> list[int]:
        if max_length is None:
            return self._tok.encode(text, add_special_tokens=bos).ids
        if max_length not in self._cut:
            from tokenizers import Tokenizer

            cut = Tokenizer.from_str(self._tok.to_str())
            cut.enable_truncation(max_length, direction="right")
            self._cut[max_length] = cut
        return self._cut[max_length].encode(text, add_special_tokens=bos).ids


def _qwen_from_vocab_merges(folder: Path):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = json.loads((folder / "vocab.json").read_text())
    merges = [tuple(line.split(" ")) for line in (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
              if line and not line.startswith("#version")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    added: dict[int, tuple[str, bool]] = {}
    config = folder / "tokenizer_config.json"
    if config.is_file():
        for i, entry in json.loads(config.read_text()).get("added_tokens_decoder", {}).items():
            added[int(i)] = (entry["content"], bool(entry.get("special", True)))
    extra = folder / "added_tokens.json"
    if extra.is_file():
        for content, i in json.loads(extra.read_text()).items():
            added.setdefault(int(i), (content, True))
    # Added tokens take the next free ids in the order added: add them by id so each lands on its own.
    for i in sorted(added):
        content, special = added[i]
        token = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        if tok.token_to_id(content) != i:
            raise KilovlaError(f"{folder}: added token {content!r} should have id {i}, gets "
                               f"{tok.token_to_id(content)} (vocab.json has {len(vocab)} entries)")
    return tok


def load_tokenizer(spec: str | Path, kind: str | None = None) -> Tokenizer:
    """"byte", a SentencePiece ``.model`` file, or a ``tokenizer.json`` / tokenizer folder, read as `kind`
    ("smolvlm2", the family's `Family.tokenizer_kind`) or else as Qwen's."""
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if not path.exists():
        raise KilovlaError(f"{path}: tokenizer not found")
    if path.is_file() and path.suffix == ".model":
        return SentencePieceTokenizer(path)
    return SmolVLM2Tokenizer(path) if kind == "smolvlm2" else QwenTokenizer(path)


# Where a published checkpoint or its user keeps the tokenizer, relative to the checkpoint folder.
_CANDIDATES = {
    "paligemma": ("paligemma_tokenizer.model", "tokenizer.model", "tokenizer/paligemma_tokenizer.model",
                  "tokenizer/tokenizer.model", "assets/paligemma_tokenizer.model"),
    "qwen3": ("tokenizer.json", "tokenizer/tokenizer.json", "eagle2_hg_model", "tokenizer"),
    "smolvlm2": ("tokenizer.json", "tokenizer/tokenizer.json", "tokenizer"),
}
_WHAT = {"paligemma": "PaliGemma's SentencePiece model (paligemma_tokenizer.model)",
         "qwen3": "Qwen3's tokenizer.json (or Isaac-GR00T's eagle2_hg_model folder)",
         "smolvlm2": "SmolVLM2's tokenizer.json (of HuggingFaceTB/SmolVLM2-500M-Video-Instruct)"}


def find_tokenizer(kind: str, explicit: str | None, near: list[Path] = (), preset: str = "",
                   recorded: Callable[[], str | None] | None = None, near_flag: str = "--policy.init_from") -> str:
    """The tokenizer a policy uses, as "byte" or an absolute path.

    `explicit` (``--policy.tokenizer``) wins; else, for a family that needs one, the tokenizer the kilovla
    policy folder training starts from names (`recorded()`, kilovla.policy_folder), else a ``kind``
    tokenizer is looked for in the folders `near` (the checkpoint training starts from, given by
    `near_flag`); a family that needs one and finds none stops here.
    """
    if kind not in TOKENIZER_KINDS:
        raise KilovlaError(f"tokenizer kind must be one of {TOKENIZER_KINDS}, not {kind!r}")
    if explicit:
        if explicit == "byte":
            return "byte"
        path = Path(explicit).expanduser()
        if not path.exists():
            raise KilovlaError(f"--policy.tokenizer={explicit}: no such file or folder")
        return str(path.resolve())
    found = recorded() if recorded is not None else None
    if found is not None:  # the folder's own, whatever the preset's kind (a converted SmolVLA's is SmolVLM2's)
        return found
    if kind == "byte":
        return "byte"
    looked = []
    for folder in near:
        folder = Path(folder)
        folder = folder if folder.is_dir() else folder.parent
        for rel in _CANDIDATES[kind]:
            candidate = folder / rel
            looked.append(str(candidate))
            if candidate.is_file() or (candidate.is_dir() and ((candidate / "tokenizer.json").is_file()
                                                                or (candidate / "vocab.json").is_file())):
                return str(candidate.resolve())
    where = f"; looked for {', '.join(looked)}" if looked else ""
    raise KilovlaError(f"{preset or 'this policy'} needs {_WHAT[kind]}: pass --policy.tokenizer=PATH or put it next "
                       f"to the checkpoint in {near_flag} (nothing is downloaded){where}")


# -- prompts -----------------------------------------------------------------------------------------
def clean_task(task: str) -> str:
    """openpi's cleaning: strip, underscores and newlines to spaces (no lower-casing)."""
    return task.strip().replace("_", " ").replace("\n", " ")


def discretize_state(state: np.ndarray, bins: int = 256) -> list[int]:
    """State normalised to [-1, 1] -> bin indices, as openpi writes it into the prompt:
    ``np.digitize`` on 256 bins of width 1/128, no clipping (below -1 gives -1, from 1 - 1/128 on 255)."""
    edges = np.linspace(-1, 1, bins + 1)[:-1]
    return (np.digitize(np.asarray(state), edges) - 1).tolist()


def build_prompt(task: str, state: np.ndarray | None = None) -> str:
    """The text of pi0's prompt (task + "\\n") or pi0.5's with discretised state."""
    task = clean_task(task)
    if state is None:
        return task + "\n"
    return f"Task: {task}, State: {' '.join(map(str, discretize_state(state)))};\nAction: "


def openpi_prompt_ids(tokenizer, task: str, state: np.ndarray | None = None) -> list[int]:
    """openpi's `PaligemmaTokenizer.tokenize`: pi0 encodes the newline separately; pi0.5 the whole string."""
    if state is None:
        return tokenizer.encode(clean_task(task), bos=True) + tokenizer.encode("\n", bos=False)
    return tokenizer.encode(build_prompt(task, state), bos=True)


EAGLE_SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
EAGLE_END = "<|im_end|>\n<|im_start|>assistant\n"
EAGLE_IMAGE_TOKEN = "<IMG_CONTEXT>"


def eagle_prompt_ids(tokenizer, task: str, n_images: int, tokens_per_image: int, image_token_id: int) -> list[int]:
    """GR00T N1.5's prompt: the Eagle 2.5 chat template with a run of `tokens_per_image` image
    placeholders per camera. The instruction is used as given (Isaac-GR00T's default)."""
    # The pieces meet at special tokens, which the tokenizer splits on before anything else: encoding
    # them one by one gives the ids of the whole string without encoding 256 placeholders per camera.
    ids, head = [], EAGLE_SYSTEM
    for k in range(1, n_images + 1):
        ids += tokenizer.encode(head + f"<image {k}><img>", bos=False) + [image_token_id] * tokens_per_image
        head = "</img>"
    return ids + tokenizer.encode((head if n_images else EAGLE_SYSTEM) + task + EAGLE_END, bos=False)


# Where transformers keeps a chat template beside a tokenizer, in the order it reads them.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def find_chat_template(folder: Path) -> Path | None:
    """The file of `folder` that holds a chat template (`CHAT_TEMPLATE_FILES`), or None. A chat_template.* file
    is the template's whatever it holds (`read_chat_template` says what is wrong with it); tokenizer_config.json
    holds one when it has the key, and one that does not parse is refused naming it."""
    for name in CHAT_TEMPLATE_FILES:
        path = folder / name
        if path.is_file() and (name.startswith("chat_template") or "chat_template" in _json_file(path)):
            return path
    return None


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise KilovlaError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(data, dict):
        raise KilovlaError(f"{path}: not a JSON object")
    return data


def read_chat_template(path: Path) -> str:
    """The template text of a `find_chat_template` file (a .jinja file, or a JSON file's "chat_template")."""
    if path.suffix == ".jinja":
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise KilovlaError(f"{path}: not a readable UTF-8 template ({e})") from None
    template = _json_file(path).get("chat_template")
    if isinstance(template, list):  # transformers' named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise KilovlaError(f"{path}: named chat templates {sorted(map(str, named))} but no \"default\" one")
        template = named["default"]
    if not isinstance(template, str):
        raise KilovlaError(f"{path}: its chat_template is not a template string")
    return template


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template compiled as transformers compiles it (a sandbox, trimmed blocks, loop controls,
    `raise_exception`); `path`: the file it was read from, which its errors name."""

    path: Path
    compiled: object  # a jinja2 Template

    def render(self, messages: list[dict]) -> str:
        """`messages` through the template, without the generation prompt."""
        import jinja2

        try:
            return self.compiled.render(messages=messages, add_generation_prompt=False)
        except (jinja2.TemplateError, RecursionError) as e:
            raise KilovlaError(f"{self.path}: the chat template does not render: {type(e).__name__}: {e}") from None


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """`folder`'s chat template (`find_chat_template`, `read_chat_template`) compiled, or None where it has none."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    path = find_chat_template(folder)
    if path is None:
        return None

    def raise_exception(message):
        raise KilovlaError(f"{path}: the chat template refused the prompt: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return ChatTemplate(path, env.from_string(read_chat_template(path)))
    except (jinja2.TemplateError, RecursionError) as e:
        raise KilovlaError(f"{path}: the chat template does not render: {type(e).__name__}: {e}") from None


QWEN3VL_IMAGE_TOKEN = "<|image_pad|>"


def formalize_language(task: str) -> str:
    """Isaac-GR00T's `formalize_language` (on by default for N1.7): lower case, punctuation removed."""
    return re.sub(r"[^\w\s]", "", task.lower())


def qwen3vl_prompt_ids(tokenizer: QwenTokenizer, task: str, n_images: int, tokens_per_image: int,
                       image_token_id: int) -> list[int]:
    """GR00T N1.7's prompt (module docstring): the tokenizer's chat template on one user turn of `n_images`
    images and the formalised task, each image's ``<|image_pad|>`` grown to `tokens_per_image` placeholders
    (as Qwen3-VL's processor does for an image of that many merged patches)."""
    template = tokenizer.chat_template
    if template is None:
        raise KilovlaError(f"{tokenizer.path}: no chat template beside the tokenizer (GR00T N1.7 places its images "
                           f"by it); looked for {', '.join(CHAT_TEMPLATE_FILES)} in {tokenizer.folder}")
    content = [{"type": "image"}] * n_images + [{"type": "text", "text": formalize_language(task)}]
    pieces = template.render([{"role": "user", "content": content}]).split(QWEN3VL_IMAGE_TOKEN)
    if len(pieces) != n_images + 1:
        raise KilovlaError(f"{template.path}: the chat template writes {len(pieces) - 1} {QWEN3VL_IMAGE_TOKEN} for "
                           f"{n_images} image(s)")
    ids = []
    for k, piece in enumerate(pieces):  # the pieces meet at a special token: their ids are the whole text's
        ids += tokenizer.encode(piece, bos=False) + ([image_token_id] * tokens_per_image if k < n_images else [])
    return ids


# The chat templates that place a family's images in its prompt (`Family.image_prompt`): the placeholder each
# image's run is made of, and the prompt builder (tokenizer, task, images, tokens per image, placeholder id).
IMAGE_PROMPTS = {"eagle": (EAGLE_IMAGE_TOKEN, eagle_prompt_ids), "qwen3-vl": (QWEN3VL_IMAGE_TOKEN, qwen3vl_prompt_ids)}


def smolvla_prompt_ids(tokenizer: SmolVLM2Tokenizer, task: str, max_length: int) -> list[int]:
    """LeRobot SmolVLA's prompt (module docstring): task + "\\n", the tokenizer's special tokens, cut to
    `max_length` by the tokenizer (what it adds kept); a cut is reported as `truncate` reports it."""
    prompt = task if task.endswith("\n") else task + "\n"
    ids = tokenizer.encode(prompt)
    if len(ids) <= max_length:
        return ids
    truncate(ids, max_length)  # the one warning of the process
    return tokenizer.encode(prompt, max_length=max_length)


_warned_truncation = False


def truncate(ids: list[int], budget: int, keep_extra: int = 0) -> list[int]:
    """Cut a prompt to `budget` tokens (+ `keep_extra` image placeholders that do not count), at the end
    as openpi does; the first cut of the process is reported with its counts."""
    global _warned_truncation
    limit = budget + keep_extra
    if len(ids) <= limit:
        return ids
    if not _warned_truncation:
        _warned_truncation = True
        log.warning("a prompt of %d language tokens is longer than max_language_tokens=%d: its last %d tokens are "
                    "cut (reported once; raise max_language_tokens to keep them)", len(ids) - keep_extra, budget,
                    len(ids) - limit)
    return ids[:limit]


def pad_prompts(ids: list[list[int]], pad_id: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens (B, L) and mask (B, L), right-padded to the longest prompt."""
    length = max(len(i) for i in ids)
    tokens = torch.full((len(ids), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(ids), length, dtype=torch.bool)
    for row, seq in enumerate(ids):
        tokens[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = True
    return tokens, mask


def tokenize_batch(tokenizer, prompts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain prompts -> tokens (B, L) and mask (B, L), L = the longest prompt (<= max_length)."""
    return pad_prompts([truncate(tokenizer.encode(p), max_length) for p in prompts])
