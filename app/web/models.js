// The model picker (PROTOCOL §13): every provider's models from /api/providers, grouped
// by provider; the choice is kept in this browser and sent as `chatModel`, and the model
// that answered is shown under each answer (from `messageEnd` or the stored answer).
import { getJson } from "./net.js";

const KEY = "chatModel";

/** Fill `select` from /api/providers; hidden when there is nothing to choose. */
export async function loadModels(select) {
  let listed;
  try {
    listed = await getJson("/api/providers");
  } catch {
    select.hidden = true;
    return;
  }
  const kept = JSON.parse(window.localStorage.getItem(KEY) || "null");
  const fallback = listed.default ? JSON.stringify(listed.default) : "";
  const values = [];
  select.replaceChildren();
  for (const provider of listed.providers || []) {
    const group = document.createElement("optgroup");
    group.label = provider.status === "ok" ? provider.name : `${provider.name} (${provider.status})`;
    for (const model of provider.models || []) {
      const option = document.createElement("option");
      option.value = JSON.stringify({ provider: provider.id, model: model.id });
      option.textContent = model.name;
      group.append(option);
      values.push(option.value);
    }
    if (group.children.length) select.append(group);
  }
  const wanted = kept ? JSON.stringify({ provider: kept.provider, model: kept.model }) : fallback;
  select.value = values.includes(wanted) ? wanted : fallback;
  select.hidden = values.length < 2;
  select.onchange = () => window.localStorage.setItem(KEY, select.value);
}

/** The request's `chatModel` field: `{chatModel: {provider, model}}`, or nothing. */
export function chosenModel(select) {
  if (select.hidden || !select.value) return {};
  return { chatModel: JSON.parse(select.value) };
}

/** Under an answer: the model that wrote it. */
export function showAnsweredBy(view, chatModel) {
  if (!chatModel || !chatModel.model) return;
  let line = view.el.querySelector(".answered-by");
  if (!line) {
    line = document.createElement("div");
    line.className = "answered-by";
    view.part("status").after(line);
  }
  line.textContent = chatModel.provider === "default" ? chatModel.model : `${chatModel.model} · ${chatModel.provider}`;
}
