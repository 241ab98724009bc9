"""The client of the daemon and its same-host fast paths: the shared index and slab (fetch.py, views.py),
the daemon's disk tier read in place (disk_reader.py), puts in place (reserve.py) and staged puts
(stage.py, put.py), Touch (touch.py),
operator calls (manage.py), malloc tuning (malloc.py); the Protocol integrations call (protocol.py),
best-effort use of the daemon (best_effort.py) and the choice of socket by the caller's account (peer.py)."""

from tiercache.client.best_effort import DAEMON_ERRORS, BestEffort
from tiercache.client.core import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES, Client, error_from_rpc
from tiercache.client.fetch import FetchedBlocks, parse_fetch_response
from tiercache.client.peer import local_client
from tiercache.client.protocol import CacheClient, Copies, Fetched
from tiercache.client.reserve import Reservation
from tiercache.client.types import (
                                    ListedBlock,
                                    Listing,
                                    NamespaceDescription,
                                    ServiceStats,
                                    TenantUsage,
                                    TierUsage,
                                    VerifyResult,
)
from tiercache.malloc import tune_malloc

__all__ = ["CHANNEL_OPTIONS", "DAEMON_ERRORS", "MAX_MESSAGE_BYTES", "BestEffort", "CacheClient", "Client", "Copies",
           "Fetched", "FetchedBlocks", "ListedBlock", "Listing", "NamespaceDescription", "Reservation", "ServiceStats",
           "TenantUsage",
           "TierUsage", "VerifyResult", "error_from_rpc", "local_client", "parse_fetch_response", "tune_malloc"]
