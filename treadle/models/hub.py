"""Models by Hugging Face Hub id: `Qwen/Qwen3-0.6B` becomes a snapshot folder in the Hub cache.

As in vLLM, `huggingface_hub.snapshot_download` fetches only what the engine reads (config,
tokenizer, safetensors), with its own progress bars, `HF_TOKEN` and `HF_ENDPOINT`. When
`HF_HUB_OFFLINE=1` is set, or the Hub cannot be reached, the snapshot already in the local cache
(`HF_HUB_CACHE`, or `download_dir`) is used. A GGUF repository holds many quantizations, so a
GGUF is named by its file: `org/repo/file.gguf` fetches that one file.
"""

from __future__ import annotations

import logging
import re
import time

logger = logging.getLogger(__name__)

# What the engine reads from a repository: configs, tokenizer files, weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
# Mistral's repos hold their weights twice: HF shards (named in the index, which the loader
# reads) and a mistral-native consolidated.safetensors, as large again.
IGNORE_PATTERNS = ["consolidated*.safetensors"]
# `name` or `org/name` (huggingface_hub's rule for repo ids), optionally `/file.gguf`.
_HUB_ID = re.compile(r"^(?P<repo>(?:[\w.-]+/)?[\w.-]+?)(?:/(?P<file>[\w.-]+\.gguf))?$")


def is_hub_id(model: str) -> bool:
    """Whether `model` is spelled as a Hub id (`name`, `org/name` or `org/name/file.gguf`).

    A bare `file.gguf` is a local file that is missing, not a repository.
    """
    m = _HUB_ID.match(model)
    return (m is not None and not model.startswith((".", "-")) and ".." not in model
            and "--" not in model and not (m["file"] is None and model.endswith(".gguf")))


def download_model(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """The local snapshot folder (or GGUF file) of Hub id `model`, downloaded if need be.

    Raises ValueError, naming the id and what to do, when it can be neither found nor fetched.
    """
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    m = _HUB_ID.match(model)
    assert m is not None, model
    repo, filename = m["repo"], m["file"]
    where = download_dir or constants.HF_HUB_CACHE
    at = f" at revision {revision!r}" if revision else ""
    start = time.perf_counter()
    try:
        if filename is not None:
            path = hf_hub_download(repo, filename, revision=revision, cache_dir=download_dir)
        else:
            path = snapshot_download(repo, revision=revision, cache_dir=download_dir,
                                     allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS)
    except RevisionNotFoundError:
        raise ValueError(f"model {model!r} has no revision {revision!r} on the Hub") from None
    except GatedRepoError:
        raise ValueError(f"model {model!r} is gated on the Hub: accept its terms on "
                         "huggingface.co and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ValueError(f"model {model!r} is neither a local folder or .gguf file nor a model "
                         "on the Hub (a private one needs HF_TOKEN)") from None
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            how = "or unset HF_HUB_OFFLINE to let treadle download it"
        else:
            how = f"once the Hub can be reached (here: {_first_line(e)})"
        raise ValueError(f"model {model!r}{at} is not in the Hugging Face cache ({where}); "
                         f"download it with `hf download {repo}` (`huggingface-cli download "
                         f"{repo}` before huggingface_hub 1.0), {how}") from None
    logger.info("model %s%s: %s (%.1f s)", model, at, path, time.perf_counter() - start)
    return path


def _first_line(error: Exception) -> str:
    """The reason huggingface_hub gives, without the advice lines it adds."""
    text = str(error.__cause__ or error).strip()
    return text.splitlines()[0] if text else type(error).__name__
