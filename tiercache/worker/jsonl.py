"""The worker's JSON-lines front end: a request per input line parsed and validated, a result per output line."""

from __future__ import annotations

import logging

from tiercache.errors import InvalidArgument, TierCacheError
from tiercache.worker.request import Request, Result, Worker

logger = logging.getLogger(__name__)

_REQUEST_FIELDS = {"prompt", "tokens", "max_new_tokens", "breakpoints", "salt", "cache", "return_scores", "id"}



def parse_request(obj: object, tokenizer) -> Request:
    """A Request from one decoded JSON line; InvalidArgument naming the bad field."""
    if not isinstance(obj, dict):
        raise InvalidArgument("a request must be a JSON object")
    unknown = sorted(set(obj) - _REQUEST_FIELDS)
    if unknown:
        raise InvalidArgument(f"unknown request field(s): {', '.join(unknown)}")
    if ("prompt" in obj) == ("tokens" in obj):
        raise InvalidArgument('give exactly one of "prompt" (a string) or "tokens" (a list of ints)')
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise InvalidArgument('"prompt" must be a string')
        if not obj["prompt"]:
            raise InvalidArgument("the prompt is empty")
        tokens = tokenizer.encode(obj["prompt"])
        preview = obj["prompt"][:64]
    else:
        tokens = obj["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidArgument('"tokens" must be a list of ints')
        preview = ""

    def _int(name: str, default: int, lo: int, hi: int) -> int:
        value = obj.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise InvalidArgument(f'"{name}" must be an int in [{lo}, {hi}], got {value!r}')
        return value

    breakpoints = obj.get("breakpoints", [])
    if not isinstance(breakpoints, list) \
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in breakpoints):
        raise InvalidArgument('"breakpoints" must be a list of token positions')
    salt = obj.get("salt", "")
    if not isinstance(salt, str):
        raise InvalidArgument('"salt" must be a string')
    cache = obj.get("cache", True)
    if not isinstance(cache, bool):
        raise InvalidArgument('"cache" must be true or false')
    return Request(tokens=tuple(tokens), max_new_tokens=_int("max_new_tokens", 16, 0, 4096),
                   breakpoints=tuple(breakpoints), salt=salt, cache=cache,
                   return_scores=_int("return_scores", 0, 0, 1000), preview=preview)


def result_to_json(result: Result, request_id: object = None) -> dict:
    out = {"text": result.text, "tokens": result.tokens, "prompt_tokens": result.prompt_tokens,
           "cached_tokens": result.cached_tokens, "computed_tokens": result.computed_tokens,
           "tiers": result.tiers, "ttft_s": round(result.ttft_s, 6), "total_s": round(result.total_s, 6),
           "prefill_s": round(result.prefill_s, 6)}
    if result.scores:
        out["scores"] = [[token, score] for token, score in result.scores]
    if result.degraded:
        out["degraded"] = result.degraded
    if request_id is not None:
        out["id"] = request_id
    return out


def run_jsonl(worker: Worker, infile, outfile) -> int:
    """Serve JSON-lines requests until EOF: one result (or {"error": ...}) per input line. Returns errors seen."""
    import json

    errors = 0
    for line in infile:
        if not line.strip():
            continue
        request_id = None
        try:
            try:
                obj = json.loads(line)
            except RecursionError:  # nested deeper than the decoder goes
                raise InvalidArgument("the request is nested too deeply to be JSON this worker reads") from None
            request_id = obj.get("id") if isinstance(obj, dict) else None
            out = result_to_json(worker.run(parse_request(obj, worker.loaded.tokenizer)), request_id)
        except (json.JSONDecodeError, TierCacheError, ValueError) as e:
            errors += 1
            out = {"error": f"{type(e).__name__}: {e}"}
        except Exception as e:  # noqa: BLE001 - a failed request (the model's own error) must not end the worker
            logger.exception("request failed")
            errors += 1
            out = {"error": f"internal error: {type(e).__name__}: {e}"}
        if "error" in out and request_id is not None:
            out["id"] = request_id
        outfile.write(json.dumps(out) + "\n")
        outfile.flush()
    worker.drain()
    return errors
