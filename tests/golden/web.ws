{"type":"signal","data":"open"}
{"type":"rewrited","content":"how falcon engines burn methane","chatId":"201","eventId":"ANSWER:1"}
{"type":"progress","data":"searching the web: how falcon engines burn methane","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:2"}
{"type":"sources","data":[{"metadata":{"title":"Result 0: history of pottery glazes","url":"http://127.0.0.1:PORT/pages/0"},"pageContent":"SNIPPET-0 about history of pottery glazes"},{"metadata":{"title":"Result 1: weather patterns over oceans","url":"http://127.0.0.1:PORT/pages/1"},"pageContent":"SNIPPET-1 about weather patterns over oceans"},{"metadata":{"title":"Result 2: recipes for sourdough bread","url":"http://127.0.0.1:PORT/pages/2"},"pageContent":"SNIPPET-2 about recipes for sourdough bread"},{"metadata":{"title":"Result 3: falcon engines burn methane and oxygen","url":"http://127.0.0.1:PORT/pages/3"},"pageContent":"SNIPPET-3 about falcon engines burn methane and oxygen"},{"metadata":{"title":"Result 4: chess openings for beginners","url":"http://127.0.0.1:PORT/pages/4"},"pageContent":"SNIPPET-4 about chess openings for beginners"},{"metadata":{"title":"Result 5: migratory birds in winter","url":"http://127.0.0.1:PORT/pages/5"},"pageContent":"SNIPPET-5 about migratory birds in winter"},{"metadata":{"title":"Result 6: ancient roman road building","url":"http://127.0.0.1:PORT/pages/6"},"pageContent":"SNIPPET-6 about ancient roman road building"},{"metadata":{"title":"Result 7: jazz improvisation techniques","url":"http://127.0.0.1:PORT/pages/7"},"pageContent":"SNIPPET-7 about jazz improvisation techniques"},{"metadata":{"title":"All Sources","url":"//127.0.0.1:PORT/sources/202"}}],"messageId":"ANSWER","chatId":"201","eventId":"ANSWER:3"}
{"type":"message","data":"","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:4"}
{"type":"reasoning","data":"why0 ","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:5"}
{"type":"reasoning","data":"why1 ","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:6"}
{"type":"message","data":"tok0 ","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:7"}
{"type":"message","data":"tok1 ","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:8"}
{"type":"message","data":"tok2 ","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:9"}
{"type":"message","data":"tok3 ","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:10"}
{"type":"message","data":"tok4 ","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:11"}
{"type":"messageEnd","status":"completed","questionMessageId":"202","messageId":"ANSWER","chatId":"201","eventId":"ANSWER:12"}
