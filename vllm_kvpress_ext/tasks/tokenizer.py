"""Word-level tokenizer for the synthetic long-context suite (`vllm_kvpress_ext.tasks.synthetic`).

The suite's model is trained from scratch on a 2-core CPU, so the vocabulary is small (a few hundred
words) and every word is exactly one token: sequence lengths are then word counts, and an answer's
tokens are its words. The vocabulary is split into *role* sets that never overlap -- keys are animals,
values are the numbers 0-99, variables are ``x0..x63``, filler is everyday words, counted items are
fruits and vegetables, markers are the few structural words of records and questions -- so a tiny model
can tell from a token alone which role it plays. Learning to bind a key to its value is hard enough
for a 1M-parameter model; it should not also have to learn which words are keys.

Text in the suite is whitespace-normalised (words joined by single spaces, no newlines), and the
tokenizer has no decoder, so ``decode(encode(text)) == text`` exactly. A post-processor prepends
``<bos>``; ``<eos>`` ends every answer (and every assistant turn of the chat template).

The files written by :func:`save_tokenizer` load with ``transformers.AutoTokenizer`` as a
``PreTrainedTokenizerFast``, chat template included, so the same tokenizer serves training,
the embedded engine and the OpenAI-compatible server.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
#: Special tokens, ids 0..6 in this order. ``<pad>`` is 0 so zero-padded batches are padding.
SPECIAL_TOKENS: tuple[str, ...] = (PAD, UNK, BOS, EOS, SYSTEM, USER, ASSISTANT)

#: Structural words of records and questions. ``.`` also ends the filler's noise sentences.
MARKER_WORDS: tuple[str, ...] = (
    *("key", "is", "var", "=", ".", ",", "?", ":", "answer"),
    *("what", "which", "are", "all", "values", "of", "keys", "variables", "equal"),
    *("most", "common", "words", "how", "many", "times", "does", "appear"),
    # Reserved for future task families, so adding one does not change the vocabulary.
    *("value", "count", "list", "first", "last", "before", "after", "yes", "no", "none"),
)

#: Keys of key/value records (animals). Multi-token keys are sequences of these.
KEY_WORDS: tuple[str, ...] = (
    *("ant", "ape", "bat", "bear", "bee", "bird", "boar", "bull", "camel", "cat"),
    *("clam", "cobra", "cod", "colt", "cow", "crab", "crane", "crow", "deer", "dingo"),
    *("dog", "dove", "duck", "eagle", "eel", "elk", "emu", "falcon", "ferret", "finch"),
    *("flea", "fly", "fox", "frog", "gecko", "gnat", "gnu", "goat", "goose", "gopher"),
    *("gull", "hare", "hawk", "hen", "heron", "hippo", "horse", "hound", "hyena", "ibis"),
    *("jackal", "jay", "kiwi", "koala", "lamb", "lark", "lemur", "leopard", "lion", "lizard"),
    *("llama", "lobster", "lynx", "mink", "mole", "monkey", "moose", "moth", "mouse", "mule"),
    *("newt", "octopus", "orca", "otter", "owl", "ox", "panda", "parrot", "pig", "pigeon"),
    *("pony", "puma", "python", "quail", "rabbit", "ram", "rat", "raven", "rhino", "robin"),
    *("salmon", "seal", "shark", "sheep", "shrew", "skunk", "sloth", "slug", "snail", "snake"),
    *("spider", "squid", "stork", "swan", "tapir", "tiger", "toad", "trout", "tuna", "turkey"),
    *("turtle", "viper", "wasp", "weasel", "whale", "wolf", "wombat", "worm", "yak", "zebra"),
    *("badger", "beaver", "bison", "cheetah", "donkey", "gorilla", "hamster", "jaguar"),
)

#: Values of records, variable assignments and counts: the numbers 0..99, one token each.
VALUE_WORDS: tuple[str, ...] = tuple(str(i) for i in range(100))

#: Variable names for variable tracking.
VARIABLE_WORDS: tuple[str, ...] = tuple(f"x{i}" for i in range(64))

#: Filler ("haystack") words; the noise sentences of the tasks use only these and ``.``.
FILLER_WORDS: tuple[str, ...] = (
    *("the", "a", "we", "they", "here", "there", "and", "back", "again", "go"),
    *("grass", "grows", "green", "sky", "looks", "blue", "sun", "shines", "bright", "river"),
    *("runs", "past", "old", "mill", "birds", "sing", "in", "tall", "trees", "wind"),
    *("blows", "over", "hills", "rain", "falls", "on", "roof", "snow", "covers", "field"),
    *("road", "leads", "to", "town", "boat", "sails", "across", "lake", "child", "plays"),
    *("with", "ball", "farmer", "walks", "slowly", "through", "quiet", "village", "morning", "evening"),
    *("night", "day", "light", "dark", "warm", "cold", "soft", "loud", "small", "big"),
    *("long", "short", "new", "early", "late", "under", "near", "far", "behind", "above"),
    *("stone", "wood", "paper", "glass", "metal", "bread", "milk", "tea", "water", "fire"),
    *("cloud", "storm", "leaf", "flower", "garden", "bridge", "tower", "window", "door", "house"),
    *("street", "market", "ship", "train", "letter", "song", "story", "book", "page", "picture"),
    *("table", "chair", "lamp", "clock", "bell", "coat", "hat", "shoe", "basket", "bottle"),
    *("cup", "plate", "spoon", "knife", "rope", "wheel", "hill", "valley"),
)

#: Items counted by the aggregation task (fruits, vegetables, grains).
ITEM_WORDS: tuple[str, ...] = (
    *("apple", "apricot", "avocado", "banana", "bean", "beet", "berry", "cabbage", "carrot", "cashew"),
    *("celery", "cherry", "chestnut", "chili", "coconut", "corn", "cucumber", "currant", "date", "fig"),
    *("garlic", "ginger", "grape", "guava", "hazelnut", "kale", "leek", "lemon", "lentil", "lettuce"),
    *("lime", "mango", "melon", "mint", "mushroom", "nutmeg", "oat", "okra", "olive", "onion"),
    *("papaya", "parsley", "pea", "peach", "peanut", "pear", "pecan", "pepper", "pineapple", "pistachio"),
    *("plum", "potato", "pumpkin", "quince", "radish", "raisin", "rice", "rye", "spinach", "tomato"),
    *("turnip", "walnut", "wheat", "yam"),
)

#: Every token, in id order. Deterministic: ids never depend on the machine or the run.
VOCABULARY: tuple[str, ...] = (
    *SPECIAL_TOKENS,
    *MARKER_WORDS,
    *KEY_WORDS,
    *VALUE_WORDS,
    *VARIABLE_WORDS,
    *FILLER_WORDS,
    *ITEM_WORDS,
)

# Roles must not overlap (a word has one role) and words must be single whitespace-free tokens.
if len(set(VOCABULARY)) != len(VOCABULARY):  # pragma: no cover - guards edits to the lists
    _dupes = sorted({w for w in VOCABULARY if VOCABULARY.count(w) > 1})
    raise RuntimeError(f"vocabulary words appear in more than one role: {_dupes}")
if any(not w or any(c.isspace() for c in w) for w in VOCABULARY):  # pragma: no cover
    raise RuntimeError("vocabulary words must be non-empty and contain no whitespace")

#: Chat template: ``<bos> <|role|> content ... <|assistant|> answer <eos>`` with single spaces, so the
#: rendered text decodes back exactly. ``<eos>`` closes each assistant turn (generation stops there).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    " <|{{ message['role'] }}|> {{ message['content'] | trim }}"
    "{% if message['role'] == 'assistant' %} {{ eos_token }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %} <|assistant|>{% endif %}"
)

#: Longest prompt the suite's model is meant for; only a hint to HF (no truncation is applied).
MODEL_MAX_LENGTH = 16384


def build_tokenizer() -> Tokenizer:
    """Build the suite's WordLevel tokenizer (``<bos>`` prepended, whitespace-split, no normaliser)."""
    vocab = {word: i for i, word in enumerate(VOCABULARY)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # WhitespaceSplit (not Whitespace): punctuation is its own word in the text format, and splitting
    # on \w boundaries would break tokens such as "x12" and "<|user|>".
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return tok


@lru_cache(maxsize=1)
def default_tokenizer() -> Tokenizer:
    """A shared instance of :func:`build_tokenizer` for callers that do not pass their own."""
    return build_tokenizer()


def tokenizer_config() -> dict[str, Any]:
    """The ``tokenizer_config.json`` contents (class, special tokens, chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT],
        # HF's clean-up would glue punctuation to the previous word ("53 ." -> "53.") and break
        # the exact round trip the suite relies on.
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "right",
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(out_dir: str | Path) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` to ``out_dir``.

    Written directly rather than through ``transformers.save_pretrained`` so the files do not depend
    on the installed transformers version. Returns the directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load a saved suite tokenizer with ``transformers.AutoTokenizer`` (a ``PreTrainedTokenizerFast``)."""
    from transformers import AutoTokenizer  # heavy import, only paid by callers that need HF

    return AutoTokenizer.from_pretrained(str(path))
