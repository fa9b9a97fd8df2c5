"""One process of a host that shares a store: fetch a version into STORE, print what it got.

    python shared_store_worker.py STORE URL PUBLISHER RUN VERSION
Prints one JSON line: the payload's content hash and the wire bytes this process downloaded.
"""

import asyncio
import json
import sys

from shardcast.fetch import fetch_version
from shardcast.hashing import content_hash
from shardcast.manifest import TrustedPublishers
from shardcast.store import Store


async def main(store: str, url: str, publisher: str, run: str, version: int) -> None:
    got = await fetch_version(Store(store), [url], TrustedPublishers([publisher]), run, version)
    print(json.dumps({"payload": content_hash(memoryview(got.payload)), "downloaded": got.wire_bytes_downloaded}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
