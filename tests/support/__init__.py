"""Small helpers the test folders share: a free loopback port (:mod:`support.net`) and
reading server-sent events (:mod:`support.sse`)."""
