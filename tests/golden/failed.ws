{"type":"signal","data":"open"}
{"type":"message","data":"","messageId":"ANSWER","chatId":"401","eventId":"ANSWER:1"}
{"type":"error","key":"STREAM_ERROR","data":"the model answered 500: fake failure 500","messageId":"ANSWER","chatId":"401","eventId":"ANSWER:2"}
