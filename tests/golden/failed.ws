{"type":"signal","data":"open"}
{"type":"message","data":"","messageId":"ANSWER","chatId":"401","eventId":"ANSWER:1"}
{"type":"error","key":"STREAM_ERROR","data":"the model failed (500); try again shortly","messageId":"ANSWER","chatId":"401","eventId":"ANSWER:2"}
