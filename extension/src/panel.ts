/**
 * The Mesh sidebar: every mesh on this machine, its hosts, procs (state, CPU and memory
 * sparklines, actors, RDMA buffers), and buttons. It only shows the model; actions are
 * callbacks given by the plugin (they need the notebook and the app).
 */
import { Widget } from '@lumino/widgets';

import { counts, IMesh, IProc, leaseText, MeshModel, stateLabel } from './model';

export interface IMeshActions {
  insertConnect(mesh: string): void;
  stop(mesh: string): void;
  respawn(mesh: string): void;
  logs(mesh: string): void;
  debug(mesh: string): void;
}

const esc = (s: unknown): string =>
  String(s).replace(/[&<>"']/g, c => `&#${c.charCodeAt(0)};`);

function spark(values: number[], max: number, color: string): string {
  if (values.length < 2) {
    return '<svg class="mk-spark" width="40" height="14"></svg>';
  }
  const w = 40;
  const h = 14;
  const top = Math.max(max, ...values, 1e-9);
  const pts = values
    .map((v, i) => `${((i / (values.length - 1)) * w).toFixed(1)},${(h - (v / top) * (h - 1)).toFixed(1)}`)
    .join(' ');
  return `<svg class="mk-spark" width="${w}" height="${h}"><polyline fill="none" stroke="${color}" stroke-width="1.2" points="${pts}"/></svg>`;
}

/** RDMA buffers registered on the mesh's procs: "3 (12.0 MiB)", or '' when none. */
function buffers(procs: IProc[]): string {
  let n = 0;
  let total = 0;
  for (const p of procs) {
    if (Array.isArray(p.buffers)) {
      n += p.buffers.length;
      total += p.buffers.reduce((s: number, x: any) => s + (x && x.size ? x.size : 0), 0);
    }
  }
  return n ? `${n} (${(total / 2 ** 20).toFixed(1)} MiB)` : '';
}

function procRow(p: IProc, hosts: boolean, gpu: boolean): string {
  const full = stateLabel(p.state);
  const state = p.state.startsWith('paused') ? 'paused' : full; // the full text is the tooltip
  const cls = p.state === 'dead' ? 'mk-dead' : p.state.startsWith('paused') ? 'mk-paused' : '';
  const num = (v: number | null, unit: string) => (v === null || v === undefined ? '' : `${v.toFixed(0)}${unit}`);
  return (
    `<tr class="mk-proc ${cls}" data-rank="${p.rank}" data-pid="${p.pid}" data-state="${esc(p.state)}">` +
    `<td>${p.rank}</td>${hosts ? `<td>${esc(p.host)}</td>` : ''}` +
    `<td class="mk-state" title="${esc(full)}">${esc(state)}</td>` +
    `<td>${spark(p.cpu_hist, 100, '#4a90d9')} ${num(p.cpu, '%')}</td>` +
    `<td>${spark(p.rss_hist, 0, '#8e44ad')} ${num(p.rss_mb, 'M')}</td>` +
    (gpu ? `<td>${spark(p.gpu_hist || [], 100, '#2e7d32')} ${num(p.gpu_util, '%')}</td>` : '') + // no GPU: no column
    '</tr>'
  );
}

function meshBlock(m: IMesh, mine: boolean): string {
  const c = counts(m);
  const status = !m.alive
    ? 'not running'
    : `${c.procs} procs on ${m.hosts.length === 1 ? m.hosts[0] : `${m.hosts.length} hosts`}` +
      (c.dead ? ` · ${c.dead} dead` : '') + (c.paused ? ` · ${c.paused} paused` : '') + ` · ${leaseText(m)}`;
  const btn = (act: string, label: string, title: string, enabled = true) =>
    `<button class="jp-mod-styled mk-btn" data-action="${act}" data-mesh="${esc(m.name)}" title="${esc(title)}"` +
    `${enabled ? '' : ' disabled'}>${label}</button>`;
  const buttons = [
    btn('connect', 'insert connect cell', `insert "%mesh connect ${m.name}" into the notebook`),
    btn('logs', 'logs', 'the procs\' output kept on their hosts', m.alive),
    btn('respawn', 'respawn dead', mine ? 'replace dead procs (mesh.respawn())' :
      'connect a notebook to this mesh first', m.alive && c.dead > 0 && mine),
    btn('debug', 'debugger', mine ? 'open the debugger on the paused ranks' :
      'connect a notebook to this mesh first', m.alive && c.paused > 0 && mine),
    btn('stop', 'stop', 'stop every proc and agent of this mesh', m.alive)
  ].join('');
  const many = new Set(m.procs.map(p => p.host)).size > 1;
  const table = m.procs.length
    ? `<table class="mk-procs"><tr><th>rank</th>${many ? '<th>host</th>' : ''}<th>state</th><th>CPU</th>` +
      `<th>memory</th>${m.gpu ? '<th>GPU</th>' : ''}</tr>${m.procs.map(p => procRow(p, many, m.gpu)).join('')}</table>`
    : '';
  const actors = [...new Set(m.procs.flatMap(p => p.actors))].sort();
  const rdma = buffers(m.procs);
  const extra =
    (actors.length ? `<div class="mk-extra">actors: ${esc(actors.join(', '))}</div>` : '') +
    (rdma ? `<div class="mk-extra">RDMA buffers: ${esc(rdma)}</div>` : '');
  const badge = mine ? ' <span class="mk-badge">this notebook</span>' : '';
  return (
    `<div class="mk-mesh${c.dead ? ' mk-has-dead' : ''}" data-mesh="${esc(m.name)}">` +
    `<div class="mk-title"><b>${esc(m.name)}</b>${badge}</div><div class="mk-status">${esc(status)}</div>` +
    `<div class="mk-buttons">${buttons}</div>${table}${extra}</div>`
  );
}

export class MeshPanel extends Widget {
  constructor(private model: MeshModel, private actions: IMeshActions) {
    super();
    this.id = 'monarch-mesh-panel';
    this.addClass('mk-panel');
    this.title.caption = 'Monarch meshes';
    this.title.label = 'Mesh';
    model.onChange(() => this.render());
    this.node.addEventListener('click', e => this.onClick(e));
    this.render();
  }

  protected onAfterShow(): void {
    this.model.watch('panel', true);
  }

  protected onAfterHide(): void {
    this.model.watch('panel', false);
  }

  protected onBeforeDetach(): void {
    this.model.watch('panel', false);
  }

  render(): void {
    const d = this.model.data;
    const head = '<div class="mk-head">Meshes on this machine</div>';
    if (!d) {
      this.node.innerHTML = head + `<div class="mk-empty">${esc(this.model.error || 'loading...')}</div>`;
      return;
    }
    const body = d.meshes.length
      ? d.meshes.map(m => meshBlock(m, m.name === d.kernel_mesh)).join('')
      : '<div class="mk-empty">No mesh yet: run <code>%mesh connect</code> in a Monarch notebook.</div>';
    const err = this.model.error ? `<div class="mk-error">${esc(this.model.error)}</div>` : '';
    this.node.innerHTML = head + err + body;
  }

  private onClick(e: MouseEvent): void {
    const b = (e.target as HTMLElement).closest('button[data-action]') as HTMLButtonElement | null;
    if (!b || b.disabled) {
      return;
    }
    const mesh = b.dataset.mesh as string;
    const act = b.dataset.action as string;
    const fn: Record<string, (m: string) => void> = {
      connect: m => this.actions.insertConnect(m),
      stop: m => this.actions.stop(m),
      respawn: m => this.actions.respawn(m),
      logs: m => this.actions.logs(m),
      debug: m => this.actions.debug(m)
    };
    fn[act]?.(mesh);
  }
}
