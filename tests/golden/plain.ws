{"type":"signal","data":"open"}
{"type":"message","data":"","messageId":"ANSWER","chatId":"101","eventId":"ANSWER:1"}
{"type":"reasoning","data":"why0 ","messageId":"ANSWER","chatId":"101","eventId":"ANSWER:2"}
{"type":"reasoning","data":"why1 ","messageId":"ANSWER","chatId":"101","eventId":"ANSWER:3"}
{"type":"message","data":"tok0 ","messageId":"ANSWER","chatId":"101","eventId":"ANSWER:4"}
{"type":"message","data":"tok1 ","messageId":"ANSWER","chatId":"101","eventId":"ANSWER:5"}
{"type":"message","data":"tok2 ","messageId":"ANSWER","chatId":"101","eventId":"ANSWER:6"}
{"type":"message","data":"tok3 ","messageId":"ANSWER","chatId":"101","eventId":"ANSWER:7"}
{"type":"message","data":"tok4 ","messageId":"ANSWER","chatId":"101","eventId":"ANSWER:8"}
{"type":"messageEnd","status":"completed","questionMessageId":"102","usage":{"prompt_tokens":38,"completion_tokens":7,"reasoning_tokens":2,"total_tokens":45},"chatModel":{"provider":"default","model":"fake-chat"},"timings":[{"stage":"modelFirstByte","startMs":0,"endMs":0},{"stage":"firstToken","startMs":0,"endMs":0}],"messageId":"ANSWER","chatId":"101","eventId":"ANSWER:9"}
