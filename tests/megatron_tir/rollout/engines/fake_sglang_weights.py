"""The fake SGLang server's weight-update endpoints (a mixin of fake_sglang.FakeSGLangServer).

Rules 1 (the weight-update session), 8 (the process group), 9 (the weight version), 10 (several groups,
one request at a time) and 11 (bucket formats) of fake_sglang.py's docstring: ``/begin_weight_update``,
``/end_weight_update``, ``/init_weights_update_group``, ``/destroy_weights_update_group``,
``/update_weights_from_distributed`` and ``/update_weights_from_tensor``, each answered as sglang
0.5.23 answers (the files are named beside each rule). Split from fake_sglang.py along the endpoint
seam; the server's state lives on the server (``FakeSGLangServer.__init__``).
"""

from __future__ import annotations

import asyncio
import ipaddress

from aiohttp import web

from sglang_schema import sglang_init_custom_process_group, sglang_tensor_bucket

NOT_IN_SESSION = "{} must run between begin_weight_update() and end_weight_update()"
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")


def tcp_address(host: str, port: int) -> str:
    """``tcp://host:port``, IPv6 in brackets (srt/utils/network.py NetworkAddress.to_tcp)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass
    return f"tcp://{host}:{port}"


def _json(body: dict, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


class WeightUpdateEndpoints:
    """``_do_<endpoint>`` handlers that ``FakeSGLangServer._control`` dispatches to."""

    async def _do_begin_weight_update(self, request, body: dict) -> web.Response:
        if self.session_open:
            return _json({"success": False, "message": "a weight-update session is already open; "
                                                       "call end_weight_update() first"}, status=400)
        self.session_open = True
        return _json({"success": True, "message": "Success"})

    async def _do_end_weight_update(self, request, body: dict) -> web.Response:
        if not self.session_open:
            return _json({"success": False, "message": "no weight-update session is open; "
                                                       "call begin_weight_update() first"}, status=400)
        self.session_open = False
        return _json({"success": True, "message": "Success"})

    def _weights_unmapped(self, request) -> web.Response | None:
        if "weights" in self.memory_freed:
            return self.crash(request, "CUDA error: an illegal memory access (a weight load into released weights)")
        return None

    def _after_update(self, body: dict, message: str) -> web.Response:
        if body.get("flush_cache", True):
            if not self.idle(ignore_waiting=self.scheduler_pause is not None):
                return _json({"success": False, "message": NOT_FLUSHED}, status=400)
            self.radix.reset()
        if body.get("weight_version") is not None:  # adopted on success only (tokenizer_control_mixin.py)
            self.weight_version = body["weight_version"]
            message += f" Weight version updated to {self.weight_version}."
        return _json({"success": True, "message": message})

    async def _do_init_weights_update_group(self, request, body: dict) -> web.Response:
        async with self.scheduler_lock:
            return await self._init_group(body)

    async def _init_group(self, body: dict) -> web.Response:
        def failed(why: str) -> web.Response:
            return _json({"success": False, "message": f"Failed to initialize custom process group: {why}."},
                         status=400)

        if self.init_failure == "hang":  # a join stuck before its rendezvous (a peer that never comes): no answer
            await asyncio.Event().wait()
        if self.init_failure is not None:  # model_runner_components/weight_updater.py:141-144 (sglang 0.5.23)
            return failed(self.init_failure)
        offset, world = body["rank_offset"], body["world_size"]
        if offset < 1 or offset + self.tp_size > world:
            return failed(f"ranks {offset}..{offset + self.tp_size - 1} do not fit world_size {world} "
                          "(rank 0 is the trainer)")
        group_name = body.get("group_name", "weight_update_group")
        if not self.join_weight_groups:
            await asyncio.sleep(self.join_wait_s)
            self.groups[group_name] = None
            return _json({"success": True, "message": "Succeeded to initialize custom process group."})
        assert self.tp_size == 1, "the fake joins with one TP rank"
        import datetime

        def join():  # in its own process: c10d registers group names process-wide
            return sglang_init_custom_process_group()(
                backend=body.get("backend", "nccl"),
                init_method=tcp_address(body["master_address"], body["master_port"]),
                world_size=world, rank=offset, group_name=group_name, timeout=datetime.timedelta(seconds=60))

        try:
            self.groups[group_name] = await asyncio.get_running_loop().run_in_executor(None, join)
        except Exception as exc:  # noqa: BLE001 - answered like SGLang's weight updater
            return failed(repr(exc))
        return _json({"success": True, "message": "Succeeded to initialize custom process group."})

    async def _do_destroy_weights_update_group(self, request, body: dict) -> web.Response:
        async with self.scheduler_lock:
            return self._destroy_group(body)

    def _destroy_group(self, body: dict) -> web.Response:
        group_name = body.get("group_name", "weight_update_group")
        if group_name not in self.groups:
            return _json({"success": False, "message": "The group to be destroyed does not exist."}, status=400)
        group = self.groups.pop(group_name)
        if group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(group)
        return _json({"success": True, "message": "Succeeded to destroy custom process group."})

    async def _do_update_weights_from_distributed(self, request, body: dict) -> web.Response:
        import torch
        import torch.distributed as dist

        from megatron_tir.rollout.sync.base import kept_bytes

        if not self.session_open:
            return _json({"success": False, "message": NOT_IN_SESSION.format("update_weights_from_distributed")},
                         status=400)
        if (gone := self._weights_unmapped(request)) is not None:
            return gone
        group_name = body.get("group_name", "weight_update_group")
        # sglang 0.5.23: the receive (model_runner_components/weight_updater.py:260-273, its group assert
        # included) raising is caught in managers/scheduler_components/weight_updater.py:209-210 ("Failed to
        # receive weights: {e}"); entrypoints/http_server.py:1500-1505 answers success false with 400
        if group_name not in self.groups:
            return _json({"success": False, "message": f"Failed to receive weights: Group {group_name} not in "
                          f"{list(self.groups)}. Please call `init_weights_update_group` first."}, status=400)
        group = self.groups[group_name]
        if self.receive_failure == "hang":  # a scheduler stuck before its receive (a dead NCCL peer): no answer
            await asyncio.Event().wait()
        if self.receive_failure:  # the broadcast raised (e.g. an NCCL error): the scheduler's answer, above
            return _json({"success": False, "message": f"Failed to receive weights: {self.receive_failure}"},
                         status=400)
        flattened = body.get("load_format") == "flattened_bucket"
        self.received.append({"group": group_name, "load_format": body.get("load_format"), "names": body["names"]})
        if group is not None:
            def receive():
                if flattened:  # _receive_bucketed_weights_from_distributed
                    buckets = sglang_tensor_bucket().FlattenedTensorBucket
                    layout = buckets.empty(body["names"], body["dtypes"], body["shapes"], "meta")  # its checks
                    nbytes = layout.get_flattened_tensor().numel()
                    memory = kept_bytes(self._receive_buffer, 0, nbytes)[:nbytes]
                    bucket = buckets(flattened_tensor=memory, metadata=layout.get_metadata())
                    dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
                    return bucket.reconstruct_tensors()
                received = []
                for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(tensor, src=0, group=group)
                    received.append((name, tensor))
                return received

            async with self.scheduler_lock:  # the receive and the load are one scheduler request
                received = await asyncio.get_running_loop().run_in_executor(None, receive)
                try:
                    await self.engine.update_weights(received)  # copies out before the buffer is reused
                except ValueError as exc:
                    return _json({"success": False, "message": str(exc)}, status=400)
            self._version_names[str(self.engine.weight_version)] = body.get("weight_version") or self.weight_version
        return self._after_update(body, "Succeeded to update parameter online.")

    async def _do_update_weights_from_tensor(self, request, body: dict) -> web.Response:
        if not self.session_open:
            return _json({"success": False, "message": NOT_IN_SESSION.format("update_weights_from_tensor")},
                         status=400)
        if (gone := self._weights_unmapped(request)) is not None:
            return gone
        if len(body["serialized_named_tensors"]) < self.tp_size:  # tp_worker.deserialize_own_rank: [tp_rank]
            return self.crash(request, "IndexError: list index out of range (serialized_named_tensors)")
        return self._after_update(body, "Success")
