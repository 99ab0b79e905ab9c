"""Tool calling for the chat endpoint: the request's tools (``request``), the formats models
write calls in (``formats``), how tools reach the chat template (``template``), the grammar of
``tool_choice`` required/named (``grammar``) and the parser that reads calls out of the output,
streamed or not (``parser``); ``constraint`` joins them to the request's other constraint."""
