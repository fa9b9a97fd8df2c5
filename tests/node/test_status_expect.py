import asyncio

from node.roles.status import serve_status


def test_status_page_answers_a_non_utf8_expect_header_with_417_not_500():
    """benchmarks.fuzz found aiohttp's default Expect handler raising on a non-UTF-8 value (a 500);
    the status page uses the shard server's handler, and a proper 100-continue still works."""

    async def body():
        runner, port = await serve_status(None, 0)  # "/" serves the static page: no service needed
        answers = []
        for expect in ["100\xc4p-continue", "100-continue"]:
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(f"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: {expect}\r\n\r\n".encode("latin-1"))
            answers.append(await asyncio.wait_for(r.read(), 5))
            w.close()
        await runner.cleanup()
        return answers

    bad, good = asyncio.run(asyncio.wait_for(body(), 30))
    assert bad.startswith(b"HTTP/1.1 417")
    assert good.startswith(b"HTTP/1.1 100 Continue") and b"HTTP/1.1 200 OK" in good
