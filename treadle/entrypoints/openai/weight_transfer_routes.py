"""HTTP routes for weights streamed from a trainer, with vLLM's paths and bodies:

    POST /init_weight_transfer_engine  {"init_info": {"master_address", "master_port",
                                        "rank_offset", "world_size", "timeout"?}}
    POST /start_weight_update          {"is_checkpoint_format": true}   (body optional)
    POST /update_weights               {"update_info": {"names", "dtype_names", "shapes",
                                        "packed"?, "packed_buffer_size_bytes"?, ...}}
    POST /finish_weight_update         {"weight_version": ...}          (body optional)

The API key guards them as it does every route. Bad input is a 400 naming the field; a call the
engine's state forbids (not enabled, no group, no round, requests running unpaused) a 409; a
transfer that failed on the wire (the trainer died, a timeout) a 502: the engine keeps its
weights and stays healthy.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import Body, FastAPI

from treadle.engine.async_llm import AsyncLLM
from treadle.engine.errors import EngineDeadError
from treadle.engine.weight_transfer import WeightTransferError
from treadle.entrypoints.openai.errors import OpenAIError

_FIELD = re.compile(r"\b((?:init|update)_info\.[a-z_]+)")


def add_weight_transfer_routes(app: FastAPI, engine: AsyncLLM) -> None:
    @app.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(
            init_info: Annotated[dict[str, Any], Body(embed=True)]) -> dict:
        await _transfer_call(engine.init_weight_transfer_engine({"init_info": init_info}))
        return {"message": "Weight transfer initialized"}

    @app.post("/start_weight_update")
    async def start_weight_update(
            is_checkpoint_format: Annotated[bool, Body(embed=True)] = True) -> dict:
        await _transfer_call(engine.start_weight_update(is_checkpoint_format))
        return {"message": "Weight update started"}

    @app.post("/update_weights")
    async def update_weights(update_info: Annotated[dict[str, Any], Body(embed=True)]) -> dict:
        count = await _transfer_call(engine.update_weights({"update_info": update_info}))
        return {"message": "Weights updated", "num_tensors": count}

    @app.post("/finish_weight_update")
    async def finish_weight_update(weight_version: Annotated[Any, Body(embed=True)] = None) -> dict:
        count, version = await _transfer_call(engine.labelled("finish_weight_update",
                                                              weight_version))
        return {"message": "Weight update finished", "num_tensors": count,
                "weight_version": version}


async def _transfer_call(call: Any) -> Any:
    try:
        return await call
    except ValueError as e:
        field = _FIELD.search(str(e))
        raise OpenAIError(400, str(e), field.group(1) if field else None) from None
    except EngineDeadError:
        raise
    except WeightTransferError as e:
        raise OpenAIError(502, str(e)) from None
    except RuntimeError as e:
        raise OpenAIError(409, str(e)) from None
